"""pytest runs against this checkout's src/ (pyproject: pythonpath), whatever is installed."""
import pytest


@pytest.fixture
def torch_quantizer(monkeypatch):
    """The reference all-reduce quantizes with quant.py (pure torch) on CUDA too, instead of the
    bit-identical Triton quantizer it picks there: GPU tests then hold the fused kernels to the
    torch reference itself."""
    from echo_tp import quant
    from echo_tp.collective import qar
    monkeypatch.setattr(qar, "codec_for", lambda x: quant)
