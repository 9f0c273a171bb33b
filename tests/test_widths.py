"""The width plan (tp/policy.site_width) on the CPU: a site's width read against the three rules
of tp/policy.py, with no model and no communicator.

  * the policy's width wins where it gives one (wider or narrower than the edge rule);
  * where it gives None, the first and last site of a quantized config run at
    max(config bits, edge_bits), every other site at the config's (None); edge_bits 0, a
    16-bit config or a model of no layers: None everywhere;
  * SP's all-gathers: the reduce width (the config's where None) widened to gather_bits,
    never narrowed; gather_bits 0: the reduce width;
  * presets: the naive '4' / '8' keep every site and gather at their own width, the paper's
    'echo4-output' has no edge rule, 'early8' is a policy; the comm spec sets the rules
    (edge_bits=, gather_bits=) and its row keeps them beside the config's fields;
  * the calibration plan of a telemetry policy: no policy, no edge rule.
Look first at tp/policy.site_width when a width is wrong, at WidthPlan.from_name or
parse_comm_spec when a preset or spec is.
"""
import pytest

from echo_tp.config import EchoConfig
from echo_tp.tp.policy import (WidthPlan, calibration_plan, make_policy, parse_comm_spec,
                               site_width)

L = 4                    # layers: sites 0 .. 7, edges 0 and 7
LAST = 2 * L - 1


def widths(plan: WidthPlan, bits: int, kind: str = "reduce", n_layers: int = L) -> list:
    return [site_width(plan, s, bits=bits, n_layers=n_layers, kind=kind)
            for s in range(2 * max(n_layers, 1))]


def test_edge_rule():
    assert widths(WidthPlan(), 4) == [8, None, None, None, None, None, None, 8]
    assert widths(WidthPlan(), 8) == [8, None, None, None, None, None, None, 8]
    assert widths(WidthPlan(edge_bits=16), 4)[0] == 16
    assert widths(WidthPlan(edge_bits=4), 8) == [8] + [None] * 6 + [8]      # never narrowed
    assert widths(WidthPlan(edge_bits=0), 4) == [None] * 8
    assert widths(WidthPlan(), 16) == [None] * 8                             # plain: untouched
    assert widths(WidthPlan(), 4, n_layers=0) == [None, None]                # no model layers


def test_policy_wins_where_it_gives_a_width():
    plan = WidthPlan(policy={0: 4, 3: 16})
    assert widths(plan, 4) == [4, None, None, 16, None, None, None, 8]
    assert widths(WidthPlan(policy="uniform4"), 4) == [4] * 8
    assert widths(WidthPlan(policy="early8", edge_bits=0), 4) == [8] * 4 + [4] * 4
    assert widths(WidthPlan(policy="first8", edge_bits=0), 4) == [8] + [None] * 7
    # resolved or not, the same widths (the TP engine holds the resolved plan)
    for p in (None, "ends8", {1: 8}, [4, 8] * L, lambda s: 16 if s == 2 else None):
        assert widths(WidthPlan(policy=p), 4) == widths(WidthPlan(policy=p).resolved(L), 4)
    assert WidthPlan(policy=make_policy("early8", L)).resolved(L).policy(0) == 8


def test_gathers():
    assert widths(WidthPlan(), 4, "gather") == [8] * 8
    assert widths(WidthPlan(gather_bits=0), 4, "gather") == [8, 4, 4, 4, 4, 4, 4, 8]
    assert widths(WidthPlan(gather_bits=0, edge_bits=0), 4, "gather") == [4] * 8
    assert widths(WidthPlan(policy={2: 16}), 4, "gather")[2] == 16            # wider kept
    assert widths(WidthPlan(), 16, "gather") == [16] * 8
    with pytest.raises(ValueError, match="kind must be one of"):
        site_width(WidthPlan(), 0, bits=4, n_layers=L, kind="all_gather")


def test_presets_specs_and_checks():
    assert WidthPlan.from_name("4") == WidthPlan(edge_bits=0, gather_bits=0)
    assert WidthPlan.from_name("8") == WidthPlan(edge_bits=0, gather_bits=0)
    assert WidthPlan.from_name("echo4-output") == WidthPlan(edge_bits=0)
    assert WidthPlan.from_name("echo4") == WidthPlan()
    for name in ("4", "8", "echo4-output", "echo4", "16", "echo4bf"):
        assert parse_comm_spec(name).widths == WidthPlan.from_name(name).replace(
            policy="config")
    spec = parse_comm_spec("early8:edge_bits=0,gather_bits=4,eta=0.5")
    assert spec.widths == WidthPlan(policy="early8", edge_bits=0, gather_bits=4)
    assert spec.config == EchoConfig(bits=4, eta=0.5)
    row = spec.as_dict()
    assert (row["policy"], row["edge_bits"], row["gather_bits"], row["eta"]) == \
        ("early8", 0, 4, 0.5)
    for bad, msg in (("echo4:edge_bits=6", "edge_bits must be one of"),
                     ("echo4:gather_bits=x", "not a valid int"),
                     ("echo4:edge=8", "unknown key")):
        with pytest.raises(ValueError, match=msg):
            parse_comm_spec(bad)
    with pytest.raises(ValueError, match="gather_bits must be one of"):
        WidthPlan(gather_bits=2)
    assert not hasattr(EchoConfig(), "edge_bits")      # the collective's config: its own fields
    cal = calibration_plan(parse_comm_spec("echo4:policy=telemetry@5,gather_bits=4").widths)
    assert cal == WidthPlan(policy=None, edge_bits=0, gather_bits=4)
    assert widths(cal, 4) == [None] * 8
