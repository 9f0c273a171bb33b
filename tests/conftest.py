"""pytest runs against this checkout's src/ (pyproject: pythonpath), whatever is installed."""
import pytest


@pytest.fixture
def torch_quantizer(monkeypatch):
    """The reference all-reduce quantizes with quant.py (pure torch) on CUDA too, instead of the
    bit-identical Triton quantizer it picks there: GPU tests then hold the fused kernels to the
    torch reference itself."""
    import importlib

    from echo_tp import quant
    qar = importlib.import_module("echo_tp.collective.qar")   # the module, not the function
    monkeypatch.setattr(qar, "codec_for", lambda x: quant)
