"""The options of `echo-tp eval` (EvalOptions: one field per command-line option) and the
checks run on them before anything is built: which implementation evaluates a model spec
(model_impl) and whether a data file is readable (check_data)."""
from __future__ import annotations

import codecs
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from echo_tp.hf.gguf import is_gguf
from echo_tp.models import ModelConfig
from echo_tp.models.tokenize import check_token_file
from echo_tp.options import cli

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


IMPLS = ("auto", "echo", "transformers")


@dataclass(frozen=True, kw_only=True)
class EvalOptions:
    """The options of `echo-tp eval` and eval.main: each field is one command-line option
    (echo_tp.options: `--field-name`, its docstring the help)."""

    model: str
    """HF checkpoint directory, a GGUF file (.gguf: transformers' model; the gguf extra), or a
    preset name or .json model config (random init from --seed)."""
    data: str
    """A token file (.bin with its .json sidecar) or a UTF-8 text file (tokenized here)."""
    comms: tuple[str, ...] = ("16", "8", "4", "echo4")
    """Comm specs NAME[:KEY=VALUE,...] (tp.policy), e.g. 16 4 echo4 early8
    'echo4:eta=0.9,quantizer=naive' (keys: bits g quantizer eta a beta1 beta2 residual
    grad_scaling state_dtype policy edge_bits gather_bits)."""
    context: int = 1024
    """Tokens per window."""
    stride: int | None = None
    """Window stride (default: --context, non-overlapping windows)."""
    batch_size: int = 4
    """Windows per forward."""
    max_windows: int | None = None
    """Evaluate at most this many windows (from the start)."""
    seed: int = 0
    """Random init of a preset model."""
    dtype: str = field(default="float32", metadata=cli(choices=DTYPES))
    """Model dtype."""
    device: str | None = None
    """Simulated runs: cpu/cuda (default cuda if any)."""
    tokenizer: str | None = None
    """Tokenizer directory or .gguf file for text data (default: the model's own: its
    directory's tokenizer.json or its GGUF metadata, else GPT-2)."""
    bos: bool = field(default=False, metadata=cli(implied_by="bos_id"))
    """Prefix each window with BOS (not scored; the same targets are scored)."""
    bos_id: int | None = None
    """BOS token id (implies --bos; default: the token file's eos_id, or the tokenizer's
    <|endoftext|>, else its own BOS token)."""
    impl: str = field(default="auto", metadata=cli(flag="--model-impl", choices=IMPLS))
    """HF directories: the project's Transformer ('echo', Llama/Qwen3 with plain RoPE) or
    transformers' own model through echo_tp.hf.load_hf_tp ('transformers': any family with a
    base_model_tp_plan); 'auto': echo where it reproduces the config, else transformers (always
    for a .gguf file)."""
    progress: bool = True
    """Show a progress bar."""
    last_word: bool = False
    """Also score last-word accuracy (LAMBADA-style: the greedy prediction of each sentence's
    final word; eval/lastword.py) on the same windows."""
    calibration_data: str | None = None
    """Token or text file of the calibration pass of telemetry policies
    (policy=telemetry@BITS; default: --data)."""
    calibration_windows: int = 8
    """Windows of that pass (from the start of the calibration data)."""
    rotate: int | None = field(default=None, metadata=cli(metavar="SEED"))
    """Fold a hidden-size rotation (Hadamard x random signs of this seed) into the weights
    first (models/rotate.py)."""
    sequence_parallel: bool = False
    """The project's Transformer sequence-parallel (tp/sequence.py): a reduce-scatter and an
    all-gather at each block boundary instead of the all-reduce (the all-gathers at the comm's
    gather_bits: 8 unless the spec says, e.g. 'echo4:gather_bits=0' for the sites' own
    width)."""
    kl: bool = False
    """Also the KL divergence of every config's next-token distributions from the 16-bit
    model's (a second copy of the model at 16 bits runs beside it: twice the forwards)."""
    out: str | None = None
    """JSON results file (with per-window NLLs)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "comms", tuple(self.comms))


def model_impl(spec: str, impl: str = "auto") -> str:
    """'echo' or 'transformers': which implementation evaluates `spec` (see the module doc)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if is_gguf(spec):
        if impl == "echo":
            raise ValueError(f"{spec} is a GGUF file, which transformers' model reads: use "
                             "--model-impl auto or transformers (or convert it with "
                             "echo_tp.hf.gguf_to_hf and pass the directory)")
        return "transformers"
    if not Path(spec).is_dir():
        if impl == "transformers":
            raise ValueError(f"--model-impl transformers needs an HF checkpoint directory or a "
                             f".gguf file; {spec!r} is neither")
        return "echo"
    config = Path(spec) / "config.json"
    if not config.is_file():
        raise ValueError(f"{spec} has no config.json; expected an HF checkpoint directory")
    if impl != "auto":
        return impl
    try:
        ModelConfig.from_hf_config(json.loads(config.read_text()))
    except (ValueError, KeyError):
        return "transformers"
    return "echo"




def check_data(data: str, what: str) -> None:
    """ValueError naming `what` unless data is a token file (.bin and its sidecar, sizes
    consistent) or a UTF-8 text file (read through once): checked before the model is built."""
    if Path(data).suffix == ".bin":
        check_token_file(data, what)
    elif Path(data).is_dir():
        raise ValueError(f"{what} {data} is a directory; name a token file or a text file")
    elif not Path(data).is_file():
        raise ValueError(f"{what} {data}: the file does not exist")
    else:
        decoder = codecs.getincrementaldecoder("utf-8")()
        try:
            with open(data, "rb") as f:
                while chunk := f.read(1 << 24):
                    decoder.decode(chunk)
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as e:
            raise ValueError(f"{what} {data} is not UTF-8 text ({e}); pass a token file (.bin) "
                             "or a UTF-8 text file") from None

