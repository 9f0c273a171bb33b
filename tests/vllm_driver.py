"""One vLLM engine run for tests/test_vllm.py, in its own process (vLLM spawns its workers, which
read ECHO_VLLM from the environment this process is given):

    python tests/vllm_driver.py MODEL_DIR PROMPTS.json OUT.json [compile]

serves MODEL_DIR at TP=2 on vLLM's CPU build (bf16; eager, or with `compile` the model traced
by torch.compile, vLLM's default, its backend as VLLM_CPU_CI_ENV picks) and writes, per prompt
of PROMPTS.json (a list of strings), the prompt's token ids, the logprob of each prompt token
after the first, and 16 greedy tokens with their logprobs. max_num_batched_tokens=128 splits the
longer prompts over several forwards, so the run holds prefill, decode and mixed forwards.
"""
import json
import sys

from vllm import LLM, SamplingParams


def main(model: str, prompts_file: str, out_file: str, mode: str = "eager") -> None:
    prompts = json.loads(open(prompts_file).read())
    llm = LLM(model=model, tensor_parallel_size=2, dtype="bfloat16", max_model_len=512,
              max_num_batched_tokens=128, enforce_eager=mode == "eager", seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=16, prompt_logprobs=0, logprobs=0)
    rows = []
    for out in llm.generate(prompts, params):
        ids = out.prompt_token_ids
        gen = out.outputs[0]
        rows.append({
            "prompt_token_ids": ids,
            "prompt_logprobs": [lp[t].logprob for t, lp in zip(ids[1:], out.prompt_logprobs[1:])],
            "token_ids": list(gen.token_ids),
            "logprobs": [lp[t].logprob for t, lp in zip(gen.token_ids, gen.logprobs)],
            "text": gen.text,
        })
    with open(out_file, "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
