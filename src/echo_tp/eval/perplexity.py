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

Sequence parallelism (`sequence_parallel`) splits each window's positions over the P ranks; a
window whose positions (T, or T + 1 after BOS) P does not divide is padded at its end to the
next multiple of P. The model is causal, so the pad positions change no logit before them;
they are not scored.

Where each part lives: the options and their checks in eval/config.py, the windows and the
per-window scores in eval/metric.py, the runner (ranks, models, comm configs, statistics,
output) in eval/runner.py, the printed table in eval/table.py.
"""
from __future__ import annotations

from .config import DTYPES, IMPLS, EvalOptions, check_data, model_impl
from .metric import WindowScores, sliding_windows, window_nll, window_scores
from .runner import load_model, main
from .table import format_table
from .text import load_eval_tokens

__all__ = ["DTYPES", "IMPLS", "EvalOptions", "check_data", "model_impl", "WindowScores",
           "sliding_windows", "window_nll", "window_scores", "load_model", "main",
           "format_table", "load_eval_tokens"]
