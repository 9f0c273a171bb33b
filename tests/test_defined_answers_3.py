"""Width plans: ranks agree on them once, a preset name means one set of widths, and bad rule
values are refused.

Compared:
  * real ranks (2 gloo processes) whose width plans differ, each way a plan can differ: the edge
    rule (8 vs 0), the all-gather rule of a sequence-parallel model (8 vs 0), the per-site
    policy, the layer count; through tp.parallelize (our Transformer, plain and sequence-
    parallel), echo_tp.hf.parallelize_hf (a transformers Llama) and tp.set_comm. Each is ONE
    ValueError on every rank, raised by parallelize before any forward, naming both ranks'
    per-site widths; ranks whose plans agree run their first forward (the check costs two
    small all-gathers at parallelize time, none per call);
  * a rank that never reaches parallelize: its peer's wait ends in PeerWaitError naming the
    rank and the width-plan stage (a 3 s group timeout);
  * EchoConfig.from_name(NAME) handed to parallelize without a plan against the comm spec
    NAME: the same width at every site (reduce and gather) for every preset, and the preset
    survives EchoConfig.replace; a config built field by field keeps the default rules;
  * WidthPlan(edge_bits=..., gather_bits=...) given 0.0, 8.0, False, True, '8', 2: a ValueError
    listing every allowed value, 0 included.
Where to look first: tp/agree.py (plan_widths, check_same_widths) for the agreement;
tp/policy.py (WidthPlan.of, PRESET_WIDTHS) and config.py (EchoConfig.preset) for the presets.
"""
import time

import pytest
import torch

from echo_tp import EchoCommunicator, EchoConfig, SimulatedCommunicator
from echo_tp.config import PAPER_STATE
from echo_tp.hf import parallelize_hf
from echo_tp.tp import WidthPlan, parallelize, parse_comm_spec, set_comm
from echo_tp.tp.agree import plan_widths
from echo_tp.tp.policy import PRESET_WIDTHS
from harness import perturbed_model, run_ranks, token_batch

T = pytest.importorskip("transformers")

PRESETS = ("16", "8", "4", "echo8", "echo4", "echo4-output", "echo4-local", "echo4-2ts",
           "echo4bf")


def _model(n_layers: int = 2):
    return perturbed_model("tiny-qwen3", {"n_layers": n_layers}, 5)


def _hf_llama():
    cfg = T.LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                        intermediate_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    return T.LlamaForCausalLM(cfg).eval()


def _catch(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


# each case: rank -> (parallelize kwargs); rank 0's plan, then rank 1's
CASES = {
    "edge 8 vs 0": [dict(policy=WidthPlan()), dict(policy=WidthPlan(edge_bits=0))],
    "gather 8 vs 0 (SP)": [dict(policy=WidthPlan(), sequence_parallel=True),
                           dict(policy=WidthPlan(gather_bits=0), sequence_parallel=True)],
    "policy": [dict(policy="early8"), dict(policy="uniform4")],
    "sequence parallel on one rank": [dict(sequence_parallel=True), dict()],
}


def _worker(rank, world_size):
    out = {}
    x, _ = token_batch(7, (2, 8))
    for case, kws in CASES.items():
        comm = EchoCommunicator.from_group(None, EchoConfig.from_name("echo4"))
        out[case] = _catch(lambda: parallelize(_model(), comm, rank, **kws[rank]))
    comm = EchoCommunicator.from_group(None, EchoConfig.from_name("echo4"))
    out["layers"] = _catch(lambda: parallelize(_model(2 + rank), comm, rank))
    comm = EchoCommunicator.from_group(None, EchoConfig.from_name("echo4"))
    out["hf"] = _catch(lambda: parallelize_hf(_hf_llama(), comm, rank,
                                              policy=WidthPlan(edge_bits=8 * (1 - rank))))
    # plans that agree run; set_comm agrees again
    model = parallelize(_model(), EchoCommunicator.from_group(
        None, EchoConfig.from_name("echo4")), rank, sequence_parallel=True)
    with torch.no_grad():
        out["agreed"] = model(x)
    comm = EchoCommunicator.from_group(None, EchoConfig.from_name("echo4"))
    out["set_comm"] = _catch(lambda: set_comm(model, comm, policy=WidthPlan(
        gather_bits=8 if rank == 0 else 16)))
    return out


@pytest.fixture(scope="module")
def gloo():
    return run_ranks(2, _worker)


@pytest.mark.parametrize("case", [*CASES, "layers", "hf", "set_comm"])
def test_differing_width_plans_are_one_error_on_every_rank(gloo, case):
    for r in range(2):
        msg = gloo[r][case]
        assert msg is not None, (case, r)
        assert msg.startswith("the TP ranks' width plans differ: rank 0 "), msg
        assert "; rank 1 " in msg and "same WidthPlan" in msg, msg
    assert gloo[0][case] == gloo[1][case]      # the same text: both ranks' widths


def test_the_message_names_both_plans(gloo):
    msg = gloo[0]["edge 8 vs 0"]
    assert "rank 0 runs 4 sites: reduce widths [8, 4, 4, 8]" in msg, msg
    assert "rank 1 runs 4 sites: reduce widths [4, 4, 4, 4]" in msg, msg
    msg = gloo[0]["gather 8 vs 0 (SP)"]
    assert "gather widths [8, 8, 8, 8]" in msg and "gather widths [8, 4, 4, 8]" in msg, msg


def test_agreeing_plans_run(gloo):
    assert torch.equal(gloo[0]["agreed"], gloo[1]["agreed"])


def _absent_peer(rank, world_size):
    if rank == 1:
        time.sleep(6)                   # never parallelizes
        return None
    comm = EchoCommunicator.from_group(None, EchoConfig.from_name("echo4"), check_config=False)
    try:
        parallelize(_model(), comm, rank)
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    return None


def test_a_missing_peer_is_named_with_the_stage(monkeypatch):
    monkeypatch.setenv("ECHO_COLLECTIVE_TIMEOUT_S", "3")
    got = run_ranks(2, _absent_peer)
    assert got[0] is not None and got[0].startswith("PeerWaitError: echo-tp rank 0 of 2"), got
    assert "width-plan agreement" in got[0], got[0]


def _widths(config, spec_or_policy, n_layers=3, sp=True):
    comm = SimulatedCommunicator(2, config)
    model = parallelize(_model(n_layers), comm, policy=spec_or_policy, sequence_parallel=sp)
    tp = model.echo_tp
    n = 2 * n_layers
    return [tp.bits(s) for s in range(n)], [tp.bits(s, "gather") for s in range(n)]


@pytest.mark.parametrize("name", PRESETS)
def test_a_preset_name_means_the_same_widths_everywhere(name):
    spec = parse_comm_spec(name)
    assert spec.config == EchoConfig.from_name(name)
    assert _widths(EchoConfig.from_name(name), None) == _widths(spec.config, spec.widths)


def test_naive_4_runs_every_site_at_4_bits():
    reduce, gather = _widths(EchoConfig.from_name("4"), None)
    assert reduce == [None] * 6 and gather == [4] * 6          # None: the config's 4 bits
    reduce, _ = _widths(EchoConfig.from_name("echo4"), None)
    assert reduce == [8, None, None, None, None, 8]            # echo4: the edge rule
    # the preset travels through replace; a bare policy keeps the preset's rules
    reduce, _ = _widths(EchoConfig.from_name("4").replace(group_size=64), "first8")
    assert reduce == [8, None, None, None, None, None]
    # a config built field by field has no preset: the default rules
    reduce, _ = _widths(EchoConfig(bits=4, eta=0.0, outlier=False), None)
    assert reduce == [8, None, None, None, None, 8]
    # the preset is not part of what the collective reads
    assert EchoConfig.from_name("4") == EchoConfig(bits=4, eta=0.0, outlier=False)
    assert EchoConfig.from_name("4").signature() == EchoConfig(bits=4, eta=0.0,
                                                               outlier=False).signature()
    assert "preset" not in parse_comm_spec("4").as_dict()
    assert set(PRESET_WIDTHS) - {"early8"} <= set(PRESETS)
    assert EchoConfig.from_name("echo4-output") == EchoConfig(
        bits=4, residual="output", eta=0.75, outlier=False, **PAPER_STATE)


@pytest.mark.parametrize("value", [0.0, 8.0, False, True, "8", 2, None, -8])
@pytest.mark.parametrize("rule", ["edge_bits", "gather_bits"])
def test_rule_values_are_ints_of_the_allowed_set(rule, value):
    with pytest.raises(ValueError) as e:
        WidthPlan(**{rule: value})
    msg = str(e.value)
    assert f"{rule} must be one of the ints (0, 4, 8, 16)" in msg, msg
    if isinstance(value, float):
        assert f"write {rule}={int(value)}" in msg, msg
    for ok in (0, 4, 8, 16):
        assert getattr(WidthPlan(**{rule: ok}), rule) == ok


def test_the_plan_vector_counts_gathers_only_under_sequence_parallelism():
    tp = parallelize(_model(), SimulatedCommunicator(2, EchoConfig()), sequence_parallel=True
                     ).echo_tp
    assert plan_widths(tp) == [1, 4, 8, 4, 4, 8, 8, 8, 8, 8]
    tp = parallelize(_model(), SimulatedCommunicator(2, EchoConfig())).echo_tp
    assert plan_widths(tp) == [0, 4, 8, 4, 4, 8]
