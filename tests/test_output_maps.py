"""Error feedback at sites behind a norm (compensator.NormOutput, mapped.py, hf/plan.output_norms).

Compared: NormOutput.tangent with torch.func.jvp of transformers' own Gemma-3 / Llama RMSNorm
(float tolerance: two fp32 evaluations of one formula, summed in other orders); the gain it
reads from a module; a chain of post-norm sites like Gemma's (site outputs 40x apart, gains
spanning 1000x) where feedback in site units makes the residual stream's error far worse than
no feedback (the failure on Gemma-3-270M) and the mapped feedback does not; which hf families
get maps; and the mapped path on simulated ranks against the unmapped one at 16 bits (equal).
Real gloo ranks against simulated ones with the maps: tests/test_hf_tp.py (REAL_QUANT gemma3).
If the chain test fails, look first at NormOutput.to_site (the estimate and the floor), then at
mapped.run_mapped (the carrier config).
"""
import pytest
import torch
import transformers as T

from echo_tp import EchoConfig, SimulatedCommunicator
from echo_tp.compensator import NormOutput
from echo_tp.hf import parallelize_hf
from echo_tp.hf.plan import output_norms


def _gemma_norm(h, seed):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    norm = Gemma3RMSNorm(h, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(h, generator=torch.Generator().manual_seed(seed)) * 5)
    return norm


@pytest.mark.parametrize("family", ("gemma3", "llama"))
def test_tangent_is_the_norms_jacobian(family):
    h = 96
    if family == "gemma3":
        norm = _gemma_norm(h, 0)
    else:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
        norm = LlamaRMSNorm(h, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(h) * 3)
    omap = NormOutput.from_module(norm, h)
    g = torch.Generator().manual_seed(int(torch.randint(0, 1000, ())))
    y = torch.randn(2, 5 * h, generator=g) * 7
    d = torch.randn(2, 5 * h, generator=g)
    _, want = torch.func.jvp(norm, (y.reshape(2, 5, h),), (d.reshape(2, 5, h),))
    got = omap.tangent(y, d)
    torch.testing.assert_close(got, want.reshape(got.shape), rtol=1e-5, atol=1e-5)
    c = torch.randn(2, 5 * h, generator=g)
    site = omap.to_site(c, y / 2, 2)
    assert site.shape == c.shape and torch.isfinite(site).all()
    assert torch.equal(omap.to_site(torch.zeros_like(c), y, 2), torch.zeros_like(c))


def _chain(cfg, maps, seed=1, P=2, T=16, H=256, K=24):
    """Residual-stream error of K post-norm sites (site k's sum passes gain_k * y / rms(y))."""
    g = torch.Generator().manual_seed(seed)
    gains = [(torch.rand(H, generator=g) ** 4) * 300 * (k % 2 + 0.05) + 0.05 for k in range(K)]
    xs = [torch.randn(P, T, H, generator=g) * (20.0 if k % 2 == 0 else 0.5) for k in range(K)]
    comm = SimulatedCommunicator(P, cfg)
    h = torch.zeros(T, H)
    exact = torch.zeros(T, H)
    with comm.pass_scope("forward"):
        for k in range(K):
            def norm(y):
                return gains[k] * y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
            om = NormOutput(gain=gains[k], eps=1e-6) if maps else None
            h = h + norm(comm.all_reduce(xs[k], output_map=om)[0])
            exact = exact + norm(xs[k].sum(0))
    return float((h - exact).norm() / exact.norm())


def test_mapped_feedback_is_never_worse_than_none():
    naive = _chain(EchoConfig(bits=4, eta=0.0), False)
    plain = _chain(EchoConfig(bits=4), False)
    mapped = _chain(EchoConfig(bits=4), True)
    assert plain > 3 * naive            # feedback in site units: the Gemma failure
    assert mapped < 1.05 * naive        # in the stream's units: no worse than no feedback
    assert _chain(EchoConfig(bits=16), True) == 0.0


def _tiny(name):
    c = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    if name == "gemma3":
        cfg = T.Gemma3TextConfig(**c, query_pre_attn_scalar=16, sliding_window=4,
                                 layer_types=["sliding_attention", "full_attention"])
        return T.Gemma3ForCausalLM(cfg).eval()
    return T.LlamaForCausalLM(T.LlamaConfig(**c)).eval()


def test_which_families_get_maps():
    gemma = _tiny("gemma3")
    norms = output_norms(gemma)
    assert sorted(norms) == [0, 1, 2, 3]
    assert norms[1] is gemma.model.layers[0].post_feedforward_layernorm
    assert output_norms(_tiny("llama")) == {}
    parallelize_hf(gemma, SimulatedCommunicator(2, EchoConfig(bits=4)))
    assert sorted(gemma.echo_tp.output_norms) == [0, 1, 2, 3]


def test_mapped_sites_run_and_stay_finite():
    torch.manual_seed(0)
    x = torch.randint(0, 128, (2, 12))
    ref = _tiny("gemma3")
    with torch.no_grad():
        want = ref(x).logits
    out = {}
    for spec in ("16", "4", "echo4"):
        model = _tiny("gemma3")
        model.load_state_dict(ref.state_dict())
        parallelize_hf(model, SimulatedCommunicator(2, EchoConfig.from_name(spec)))
        with torch.no_grad():
            out[spec] = model(x).logits
    torch.testing.assert_close(out["16"], want, atol=1e-5, rtol=0)
    assert torch.isfinite(out["echo4"]).all()
    assert not torch.equal(out["echo4"], out["16"])
