"""`echo-tp eval`: perplexity of one model under a list of comm configs, in one invocation.

    main(model="qwen3-150m" | "/path/to/hf_dir" | "model.gguf", data="wiki.valid.raw" | "val.bin",
         comms=["16", "8", "4", "echo4", "early8", "echo4:eta=0.9,quantizer=naive"],
         simulate=4)                                     # or world_size=4, or under torchrun

The model is loaded once (an HF checkpoint directory, a GGUF file, or a preset with a seeded
random init),
parallelized once, and pointed at each comm config in turn (tp.set_comm), so every config sees
the same weights and the same windows.

Which implementation runs an HF directory (`impl`): "echo" is the project's own Transformer
(echo_tp.models: Llama / Qwen3 with plain RoPE, tp.parallelize); "transformers" is
transformers' own model class for the config (any family echo_tp.hf supports: Qwen2, Gemma 2/3,
Mistral, Phi-3, Llama 3.1+ rope scaling, ...), loaded by echo_tp.hf.load_hf_tp (each rank reads
only its slices; the same TP engine, Echo at the same 2L sites). "auto" (default) keeps the
project's model for every config it reproduces (ModelConfig.from_hf_config accepts it) and
uses transformers for the rest. A GGUF file always runs transformers' model (read by its GGUF
loader, echo_tp.hf.gguf). Text data is tokenized by the model's own tokenizer (a directory's
tokenizer.json, a GGUF file's metadata; the tokenizers pipeline, post-processor included: a BOS
the tokenizer adds stays) unless `tokenizer` names another (eval/text.py).

Windows (`sliding_windows`): fixed context T, stride S (default S = T: non-overlapping). Window k
reads tokens [kS, kS + T) and predicts [kS + 1, kS + T]. The first window scores all T targets,
every later one only its last S targets (the ones no earlier window scored), so with S < T each
scored token sees at least T - S tokens of context. Tokens past the last full window are dropped.
Perplexity = exp(total NLL / scored tokens), NLL summed in float64.

BOS-started windows (`bos_id`, `--bos`), as a model trained with `echo-tp train --bos` sees its
sequences and as serving starts a prompt: each window's T tokens are read after one BOS token
(T + 1 positions); the BOS position's prediction is not scored, so exactly the same targets are
scored as without BOS. The BOS id defaults to the token file's eos_id (its document separator,
the BOS of GPT-2-style vocabularies), for a text file the tokenizer's <|endoftext|>, else the BOS
token the tokenizer declares (Gemma's <bos>; eval/text.py data_bos_id).

Fidelity to the 16-bit model (`kl`, `--kl`): a second copy of the model at 16 bits runs on the
same batches, and each row gets the mean KL(p_16 || p_config) of the next-token distributions
over the scored tokens with a bootstrap interval over windows. Perplexity change measures how
the noise moves the targets' NLL; on a model far outside its training text the two can rank
configs differently (studies/kl_probe.py, docs/results/2026-12-01-fidelity-testbed.md).
"""
from __future__ import annotations

import codecs
import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from echo_tp.config import EchoConfig
from echo_tp.hf.gguf import check_gguf_file, is_gguf, require_gguf_support
from echo_tp.models import (ModelConfig, build_meta_model, init_weights, load_hf_checkpoint,
                            resolve_model_config)
from echo_tp.models.checkpoint import check_shards
from echo_tp.models.rotate import rotate_hidden
from echo_tp.models.tokenize import check_token_file, token_file_info
from echo_tp.options import cli
from echo_tp.paths import check_file_target, writing
from echo_tp.tp import parallelize, parse_comm_specs, set_comm
from echo_tp.tp.policy import (average_wire_bits, calibration_plan, site_width, telemetry_budget,
                               telemetry_policy, wire_bits_per_value)
from echo_tp.tp.runtime import check_group_args, launch, make_comm, rank_device

from .lastword import target_spans, token_classes, word_hits
from .stats import gap_closed_table, mean_per_token, paired_difference
from .text import (check_tokenizer, data_bos_id, load_eval_tokens, text_tokenizer,
                   tokenizer_source)

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
    """Show a progress bar (--no-progress: none)."""
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


def sliding_windows(n_tokens: int, context: int, stride: int | None = None,
                    max_windows: int | None = None) -> list[tuple[int, int]]:
    """(start, first scored position) of each window over a stream of n_tokens."""
    stride = context if stride is None else stride
    if context < 1 or not 1 <= stride <= context:
        raise ValueError(f"need context >= 1 and 1 <= stride <= context, got {context}, {stride}")
    if n_tokens < context + 1:
        raise ValueError(f"{n_tokens} tokens do not fill one window of {context} (+1 target); "
                         "lower --context")
    count = (n_tokens - 1 - context) // stride + 1
    if max_windows is not None:
        count = min(count, max_windows)
    return [(k * stride, 0 if k == 0 else context - stride) for k in range(count)]


def load_model(spec: str, *, seed: int, dtype: torch.dtype, device: torch.device):
    """(Transformer in eval mode, ModelConfig) from an HF directory, a preset name or a .json
    model config."""
    if Path(spec).is_dir():
        return load_hf_checkpoint(spec, dtype=dtype, device=device)
    cfg = resolve_model_config(spec)
    model = init_weights(build_meta_model(cfg).to_empty(device=device), seed=seed)
    return model.to(dtype).eval(), cfg


@dataclass
class WindowScores:
    """What one config scores on the windows: nll [W] float64 (summed NLL per window), count
    [W] int64 (scored targets per window), correct [n_tokens] int8 (1 / 0: the argmax predicted
    the token at that position right / wrong; -1: not a scored target)."""

    nll: torch.Tensor
    count: torch.Tensor
    correct: torch.Tensor
    kl: torch.Tensor | None = None
    """[W] float64: summed KL(reference || model) of the next-token distributions per window
    (window_scores(reference=...)), else None."""


@torch.inference_mode()
def window_scores(model, tokens: torch.Tensor, windows, *, context: int, batch_size: int,
                  device, bar=None, bos_id: int | None = None, reference=None) -> WindowScores:
    """Per-window NLL and per-token argmax hits over windows of `context` tokens (each read
    after a BOS token when bos_id is given; its position is not scored); with reference (a
    second forward, e.g. the 16-bit model), the per-window KL(reference || model) too."""
    T = context
    kl_w = None if reference is None else torch.zeros(len(windows), dtype=torch.float64)
    nll_w = torch.zeros(len(windows), dtype=torch.float64)
    count_w = torch.zeros(len(windows), dtype=torch.long)
    correct = torch.full((tokens.numel(),), -1, dtype=torch.int8)
    for i in range(0, len(windows), batch_size):
        batch = windows[i:i + batch_size]
        x = torch.stack([tokens[s:s + T] for s, _ in batch]).to(device)          # [B, T]
        y = torch.stack([tokens[s + 1:s + T + 1] for s, _ in batch]).to(device)  # [B, T]
        if bos_id is not None:
            x = torch.cat([x.new_full((len(batch), 1), bos_id), x], dim=1)     # [B, T + 1]
        logits = model(x)                                              # [B, T (+ 1), V]
        logits = getattr(logits, "logits", logits)  # a transformers ModelOutput
        if bos_id is not None:
            logits = logits[:, 1:]  # the BOS position predicts x's first token: not scored
        nll = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
        nll = nll.view(len(batch), T).double().cpu()
        hit = (logits.argmax(-1) == y).to(torch.int8).cpu()                     # [B, T]
        kl = None
        if reference is not None:
            ref = reference(x)
            ref = getattr(ref, "logits", ref)
            ref_lp = (ref[:, 1:] if bos_id is not None else ref).float().log_softmax(-1)
            lp = logits.float().log_softmax(-1)
            kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1).double().cpu()          # [B, T]
        for b, (s, first) in enumerate(batch):
            if kl is not None:
                kl_w[i + b] = kl[b, first:].sum()
            nll_w[i + b] = nll[b, first:].sum()
            count_w[i + b] = T - first
            correct[s + 1 + first:s + 1 + T] = hit[b, first:]
        if bar is not None:
            bar.update(len(batch))
    return WindowScores(nll=nll_w, count=count_w, correct=correct, kl=kl_w)


def window_nll(model, tokens: torch.Tensor, windows, *, context: int, batch_size: int, device,
               bar=None, bos_id: int | None = None) -> tuple[float, int]:
    """(sum of NLL in float64, scored tokens) over the windows (window_scores, summed)."""
    sc = window_scores(model, tokens, windows, context=context, batch_size=batch_size,
                       device=device, bar=bar, bos_id=bos_id)
    return float(sc.nll.sum()), int(sc.count.sum())


def _rank_eval(rank: int | None, world_size: int, opts: EvalOptions) -> list[dict]:
    device = rank_device(opts.device, rank)
    if opts.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {opts.dtype!r}")
    specs = parse_comm_specs(list(opts.comms))
    hf = model_impl(opts.model, opts.impl) == "transformers"
    if hf:
        from echo_tp.hf import load_hf_tp
        from echo_tp.hf.plan import text_config
        first = make_comm(rank, world_size, specs[0].config)
        model = load_hf_tp(opts.model, first, rank, dtype=DTYPES[opts.dtype], device=device,
                           policy=specs[0].widths)
        vocab_size = text_config(model).vocab_size
        forward = lambda x: model(x, use_cache=False).logits  # noqa: E731 - [B, T, V]
    else:
        model, cfg = load_model(opts.model, seed=opts.seed, dtype=DTYPES[opts.dtype],
                                device=device)
        vocab_size, forward = cfg.vocab_size, model
        if opts.rotate is not None:
            rotate_hidden(model, opts.rotate)
    reference = _reference_model(opts, rank, world_size, device, hf) if opts.kl else None
    tokens = load_eval_tokens(opts.data, model_spec=opts.model, tokenizer=opts.tokenizer)
    if tokens.numel() and int(tokens.max()) >= vocab_size:
        raise ValueError(f"token id {int(tokens.max())} >= the model's vocab_size "
                         f"{vocab_size}: data and model use different tokenizers")
    if opts.bos_id is not None and not 0 <= opts.bos_id < vocab_size:
        raise ValueError(f"BOS id {opts.bos_id} is outside the model's vocabulary "
                         f"[0, {vocab_size})")
    windows = sliding_windows(tokens.numel(), opts.context, opts.stride, opts.max_windows)
    calib = _calibration_windows(opts, specs, vocab_size)
    main = rank in (None, 0)
    bar = None
    if opts.progress and main:
        bar = tqdm(total=len(windows) * len(specs), desc="eval", unit="win")
    results, scores = [], []
    for i, spec in enumerate(specs):
        widths, extra = spec.widths, {}
        if telemetry_budget(widths.policy) is not None:
            table, extra = _calibrate(forward, model, rank, world_size, spec, calib, opts,
                                      device, first_use=i == 0 and not hf)
            widths = widths.replace(policy=table)
        if i == 0 and hf:
            comm = first  # load_hf_tp parallelized with it
        else:
            comm = make_comm(rank, world_size, spec.config)
        if i == 0 and not hf and not extra:
            parallelize(model, comm, rank, policy=widths,
                        sequence_parallel=opts.sequence_parallel)
        elif i > 0 or extra:
            set_comm(model, comm, policy=widths)
        if bar is not None:
            bar.set_postfix_str(spec.label)
        t0 = time.perf_counter()
        sc = window_scores(forward, tokens, windows, batch_size=opts.batch_size, device=device,
                           bar=bar, context=opts.context, bos_id=opts.bos_id,
                           reference=reference)
        nll, n = float(sc.nll.sum()), int(sc.count.sum())
        scores.append(sc)
        results.append({**spec.as_dict(), **extra, "ppl": math.exp(nll / n), "nll": nll / n,
                        "tokens": n, "windows": len(windows),
                        "seconds": time.perf_counter() - t0})
        comm.close()
    if bar is not None:
        bar.close()
    _add_statistics(results, scores, tokens, windows, opts, model.echo_tp.n_layers)
    return results


def _reference_model(opts: EvalOptions, rank, world_size: int, device, hf: bool):
    """The forward of a second copy of the model at 16 bits (the KL reference): the same
    weights, rotation and sequence parallelism as the evaluated one."""
    comm = make_comm(rank, world_size, EchoConfig(bits=16))
    if hf:
        from echo_tp.hf import load_hf_tp
        ref = load_hf_tp(opts.model, comm, rank, dtype=DTYPES[opts.dtype], device=device)
        return lambda x: ref(x, use_cache=False).logits  # noqa: E731 - [B, T, V]
    ref, _ = load_model(opts.model, seed=opts.seed, dtype=DTYPES[opts.dtype], device=device)
    if opts.rotate is not None:
        rotate_hidden(ref, opts.rotate)
    parallelize(ref, comm, rank, sequence_parallel=opts.sequence_parallel)
    return ref


def _calibration_windows(opts: EvalOptions, specs, vocab_size: int):
    """(tokens, windows) of the calibration pass of telemetry policies (None if none asks)."""
    if not any(telemetry_budget(s.widths.policy) is not None for s in specs):
        return None
    data = opts.calibration_data or opts.data
    tokens = load_eval_tokens(data, model_spec=opts.model, tokenizer=opts.tokenizer)
    if tokens.numel() and int(tokens.max()) >= vocab_size:
        raise ValueError(f"calibration data {data}: token id {int(tokens.max())} >= the "
                         f"model's vocab_size {vocab_size}")
    return tokens, sliding_windows(tokens.numel(), opts.context, None, opts.calibration_windows)


def _calibrate(forward, model, rank, world_size, spec, calib, opts, device, *, first_use):
    """One telemetry pass at the spec's own width at every site (policy.calibration_plan) ->
    (its {site: bits} table, row fields)."""
    score, budget = telemetry_budget(spec.widths.policy)
    comm = make_comm(rank, world_size, spec.config, telemetry=True)
    widths = calibration_plan(spec.widths)
    if first_use:
        parallelize(model, comm, rank, policy=widths, sequence_parallel=opts.sequence_parallel)
    else:
        set_comm(model, comm, policy=widths)
    tokens, windows = calib
    window_scores(forward, tokens, windows, batch_size=opts.batch_size, device=device,
                  context=opts.context, bos_id=opts.bos_id)
    rows = comm.telemetry_summary()
    comm.close()
    table = telemetry_policy(rows, budget, spec.config, score=score)
    numel = {int(r["site"]): int(r["numel"]) for r in rows if r["direction"] == "forward"}
    return table, {"policy_table": {str(k): v for k, v in sorted(table.items())},
                   "wire_bits": average_wire_bits(spec.config, table, numel),
                   "calibration": {"data": opts.calibration_data or opts.data,
                                   "windows": len(windows)}}


def _reference_rows(results: list[dict]) -> tuple[int | None, int | None]:
    """Indices of the 16-bit row and the uncompensated 4-bit row (labels '16' and '4' first,
    else the first row of that kind), None where absent."""
    def find(label, test):
        for i, r in enumerate(results):
            if r["label"] == label:
                return i
        return next((i for i, r in enumerate(results) if test(r)), None)
    r16 = find("16", lambda r: r["bits"] == 16 and r["policy"] in ("config", "16"))
    r4 = find("4", lambda r: r["bits"] == 4 and r["eta"] == 0 and r["policy"] == "config")
    return r16, r4


def _add_statistics(results, scores, tokens, windows, opts: EvalOptions, n_layers: int) -> None:
    """Wire bits of every row; with a 16-bit and a 4-bit row, the gap each row closes with a
    paired-bootstrap interval over windows; with opts.last_word, last-word accuracy."""
    for r, spec in zip(results, parse_comm_specs(list(opts.comms))):
        if "wire_bits" not in r:
            r["wire_bits"] = _policy_wire_bits(spec, n_layers, opts.sequence_parallel)
    nll = torch.stack([sc.nll for sc in scores])                          # [C, W]
    count = scores[0].count
    r16, r4 = _reference_rows(results)
    if r16 is not None and r4 is not None:
        for r, st in zip(results, gap_closed_table(nll, count, r16, r4, seed=opts.seed)):
            r.update(st)
    elif r16 is not None:
        for r, st in zip(results, gap_closed_table(nll, count, r16, r16, seed=opts.seed)):
            r.update({k: v for k, v in st.items() if k.startswith("ppl_change")})
    for r, sc in zip(results, scores):
        r["window_nll"] = sc.nll.tolist()
        if sc.kl is not None:
            r["kl"], r["kl_ci"] = mean_per_token(sc.kl, sc.count, seed=opts.seed)
    if opts.last_word:
        classes = token_classes(text_tokenizer(_data_tokenizer(opts))[0],
                                int(max(int(tokens.max()) + 1, 1)))
        spans = target_spans(tokens, windows, opts.context, classes)
        hits = torch.stack([word_hits(sc.correct, spans) for sc in scores])  # [C, K]
        ref = r16 if r16 is not None else 0
        for r, st in zip(results, paired_difference(hits, ref, seed=opts.seed)):
            r.update({"last_word_" + k: v for k, v in st.items()}, last_word_targets=len(spans))


def _policy_wire_bits(spec, n_layers: int, sequence_parallel: bool = False) -> float:
    """Average wire bits per value of a preset policy (every site the same size); sequence-
    parallel: each site's reduce-scatter and all-gather move the same values."""
    plan = spec.widths.resolved(n_layers)
    kinds = ("reduce", "gather") if sequence_parallel else ("reduce",)
    bits = [wire_bits_per_value(spec.config, site_width(plan, s, bits=spec.config.bits,
                                                        n_layers=n_layers, kind=kind))
            for kind in kinds for s in range(2 * n_layers)]
    return sum(bits) / len(bits)


def _data_tokenizer(opts: EvalOptions) -> str | None:
    """The tokenizer of the eval data: a token file's sidecar name, else as for text."""
    if Path(opts.data).suffix == ".bin":
        name = token_file_info(opts.data).get("tokenizer") or opts.tokenizer
        if name is None:
            raise ValueError(f"last_word: {opts.data}'s sidecar names no tokenizer (the words "
                             "are read from its token strings); pass --tokenizer")
        return name
    return tokenizer_source(opts.model, opts.tokenizer)


def format_table(results: list[dict]) -> str:
    """A fixed-width table: one row per comm config, ppl change against the first row; with
    bootstrap statistics (see _add_statistics), the gap closed and its 95% interval, the wire
    bits per value and the last-word accuracy."""
    base = results[0]["ppl"]
    width = max(12, *(len(r["label"]) for r in results))
    gap = any(r.get("gap_closed") is not None for r in results)
    lw = any(r.get("last_word_accuracy") is not None for r in results)
    kl = any(r.get("kl") is not None for r in results)
    head = (f"{'comm config':<{width}}  {'ppl':>10}  {'vs ' + results[0]['label']:>12}  "
            f"{'tokens':>9}  {'s':>7}")
    if "wire_bits" in results[0]:
        head += f"  {'bits/val':>8}"
    if gap:
        head += f"  {'gap closed [95% CI]':>24}"
    if lw:
        head += f"  {'last-word %':>11}"
    if kl:
        head += f"  {'KL vs 16-bit [95% CI]':>30}"
    lines = [head]
    for r in results:
        line = (f"{r['label']:<{width}}  {r['ppl']:>10.4f}  {r['ppl'] - base:>+12.4f}  "
                f"{r['tokens']:>9}  {r['seconds']:>7.1f}")
        if "wire_bits" in r:
            line += f"  {r['wire_bits']:>8.3f}"
        if gap:
            g, ci = r.get("gap_closed"), r.get("gap_closed_ci")
            cell = "" if g is None else f"{g:6.1%} [{ci[0]:6.1%}, {ci[1]:6.1%}]"
            line += f"  {cell:>24}"
        if lw:
            line += f"  {r['last_word_accuracy']:>11.2f}"
        if kl:
            k, ci = r.get("kl"), r.get("kl_ci")
            cell = "" if k is None else f"{k:.2e} [{ci[0]:.2e}, {ci[1]:.2e}]"
            line += f"  {cell:>30}"
        lines.append(line)
    return "\n".join(lines)


def main(*, simulate: int | None = None, world_size: int | None = None, **options
         ) -> list[dict]:
    """Perplexity of `model` on `data` under every comm config (options: EvalOptions'
    fields); prints a table (rank 0), writes JSON to `out` when given, returns the result rows
    (rank 0's; every rank computes the same). bos=True: BOS-started windows (bos_id, default:
    see the module doc). The TP group: tp.runtime.Group."""
    opts = EvalOptions(**options)
    model, data, comms, bos, bos_id = opts.model, opts.data, opts.comms, opts.bos, opts.bos_id
    out, tokenizer, calibration_data = opts.out, opts.tokenizer, opts.calibration_data
    if opts.batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {opts.batch_size}")
    check_group_args(simulate=simulate, world_size=world_size)
    parse_comm_specs(list(comms))  # fail fast, before any process starts
    if out:
        check_file_target(out, "--out")
    which = model_impl(model, opts.impl)
    if bos_id is not None and not bos:
        raise ValueError("bos_id needs bos=True")
    if opts.sequence_parallel and which != "echo":
        raise ValueError("sequence_parallel: eval runs the project's own Transformer "
                         "sequence-parallel (model impl 'echo')")
    if opts.rotate is not None and which != "echo":
        raise ValueError("rotate: the hidden-size rotation is folded into the project's own "
                         "Transformer only (model impl 'echo')")
    if opts.calibration_windows < 1:
        raise ValueError(f"calibration_windows must be >= 1, got {opts.calibration_windows}")
    if Path(model).is_dir():
        check_shards(model)            # every shard opens: a truncated one is named here
    elif is_gguf(model):
        check_gguf_file(model)
        try:
            require_gguf_support()     # the extra, before any process starts
        except ImportError as e:
            raise ValueError(str(e)) from None   # a user's set-up: one line, not a traceback
    check_data(data, "--data")
    if calibration_data:
        check_data(calibration_data, "--calibration-data")
    if tokenizer:
        check_tokenizer(tokenizer)
    if bos and bos_id is None:
        bos_id = data_bos_id(data, model_spec=model, tokenizer=tokenizer)
    opts = dataclasses.replace(opts, impl=which, bos_id=bos_id)
    if opts.last_word:
        _data_tokenizer(opts)   # fail before the evaluation if no tokenizer can be named
    run = launch(_rank_eval, opts, simulate=simulate, world_size=world_size)
    results = run.result
    if run.is_main:
        P = simulate or world_size or _world()
        mode = "simulated" if simulate else "real"
        context, stride = opts.context, opts.stride or opts.context
        print(f"model {model} ({which}) | data {data} | TP={P} ({mode}) | context {context}, "
              f"stride {stride}{f', after BOS {bos_id}' if bos else ''} | "
              f"{results[0]['windows']} windows, "
              f"{results[0]['tokens']} scored tokens")
        print(format_table(results))
        if out:
            record = {"model": model, "impl": which, "data": data, "world_size": P, "mode": mode,
                      "context": context, "stride": stride, "bos_id": bos_id,
                      "dtype": opts.dtype, "seed": opts.seed, "rotate": opts.rotate,
                      "sequence_parallel": opts.sequence_parallel, "results": results}
            with writing(out):
                Path(out).parent.mkdir(parents=True, exist_ok=True)
                Path(out).write_text(json.dumps(record, indent=2) + "\n")
    return results


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


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
