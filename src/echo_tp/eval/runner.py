"""`echo-tp eval`'s runner: checks the options, loads and parallelizes the model once per rank,
points it at each comm config in turn (a telemetry policy's calibration pass first), scores the
windows (eval/metric.py), adds the statistics (gap closed, KL, last-word accuracy, wire bits),
prints the table on rank 0 and writes the JSON record."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from echo_tp.config import EchoConfig
from echo_tp.hf.gguf import check_gguf_file, is_gguf, require_gguf_support
from echo_tp.models import build_meta_model, init_weights, load_hf_checkpoint, resolve_model_config
from echo_tp.models.checkpoint import check_shards
from echo_tp.models.rotate import rotate_hidden
from echo_tp.models.tokenize import token_file_info
from echo_tp.paths import check_file_target, writing
from echo_tp.tp import parallelize, parse_comm_specs, set_comm
from echo_tp.tp.policy import (average_wire_bits, calibration_plan, site_width, telemetry_budget,
                               telemetry_policy, wire_bits_per_value)
from echo_tp.tp.runtime import check_group_args, launch, make_comm, rank_device

from .config import DTYPES, EvalOptions, check_data, model_impl
from .lastword import target_spans, token_classes, word_hits
from .metric import sliding_windows, window_scores
from .stats import gap_closed_table, mean_per_token, paired_difference
from .table import format_table
from .text import (check_tokenizer, data_bos_id, load_eval_tokens, text_tokenizer,
                   tokenizer_source)


def load_model(spec: str, *, seed: int, dtype: torch.dtype, device: torch.device):
    """(Transformer in eval mode, ModelConfig) from an HF directory, a preset name or a .json
    model config."""
    if Path(spec).is_dir():
        return load_hf_checkpoint(spec, dtype=dtype, device=device)
    cfg = resolve_model_config(spec)
    model = init_weights(build_meta_model(cfg).to_empty(device=device), seed=seed)
    return model.to(dtype).eval(), cfg



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
    multiple = world_size if opts.sequence_parallel else 1   # SP splits positions over P
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
                           reference=reference, multiple=multiple)
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
                  context=opts.context, bos_id=opts.bos_id,
                  multiple=world_size if opts.sequence_parallel else 1)
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



def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
