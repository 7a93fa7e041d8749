"""Probes of transformers' ContinuousBatchingManager on CPU: per-request seeds, logprobs, KV
reuse across turns (the properties docs/engine.md compares with tiller's engine).

    .venv/bin/python benchmarks/cb_manager_probe.py [--model PATH]

Prints (1) whether a prompt's tokens under one manager seed are the same alone and among 15
other prompts, (2) the largest gap between the manager's logprobs and log_softmax(logits / T)
of a plain forward (T = 1, T = 0.7, and T = 1 with top_k = 5 against the untruncated value),
(3) the manager's own log line of the prefix it reused for a session's second turn.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

sys.path.insert(0, str(Path(__file__).parent))
import engine as bench  # noqa: E402  (benchmarks/engine.py: prompts and sampling params)

from tiller.models import load_model, load_tokenizer  # noqa: E402
from tiller.runtime import apply_threads  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="runs/seeds/seed0/checkpoints/sft")
    args = ap.parse_args()
    apply_threads(1)
    tok = load_tokenizer(args.model)
    model = load_model(args.model).eval()
    model.set_attn_implementation("sdpa")
    stop = list(bench.params_for(tok, model, 24).stop_token_ids)
    prompts = bench.calc_prompts(tok, 16)

    def gen(batch, seed, top_k=0, temperature=1.0):
        cb = ContinuousBatchingConfig(return_logprobs=True, seed=seed, page_size=16,
                                      num_blocks=512, max_batch_tokens=4096,
                                      max_requests_per_batch=64)
        g = GenerationConfig(do_sample=True, temperature=temperature, top_k=top_k, top_p=1.0,
                             max_new_tokens=24, eos_token_id=stop, pad_token_id=tok.pad_token_id)
        out = model.generate_batch(batch, generation_config=g, continuous_batching_config=cb)
        return [out[k] for k in sorted(out, key=lambda k: int(k.split("_")[1]))]

    alone = gen(prompts[:1], 123)[0].generated_tokens
    crowd = gen(prompts, 123)[0].generated_tokens
    again = gen(prompts[:1], 123)[0].generated_tokens
    print(f"seeds: alone == alone again: {alone == again}; alone == in a crowd: {alone == crowd}")

    def check(outs, temperature, label):
        worst = 0.0
        for p, o in zip(prompts, outs, strict=True):
            ids = torch.tensor([p + o.generated_tokens])
            with torch.no_grad():
                logits = model(ids).logits[0, len(p) - 1:-1].float()
            ref = torch.log_softmax(logits / temperature, -1).gather(
                -1, torch.tensor(o.generated_tokens)[:, None])[:, 0]
            worst = max(worst, (ref - torch.tensor(o.logprobs)).abs().max().item())
        print(f"logprobs {label}: max |manager - log_softmax(logits / T)| = {worst:.2e}")

    check(gen(prompts, 1), 1.0, "T=1")
    check(gen(prompts, 1, temperature=0.7), 0.7, "T=0.7")
    check(gen(prompts, 1, top_k=5), 1.0, "T=1 top_k=5 (vs untruncated)")

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.DEBUG)  # "prefix match"
    cb = ContinuousBatchingConfig(return_logprobs=True, seed=1, page_size=16, num_blocks=512,
                                  max_batch_tokens=4096, max_requests_per_batch=64)
    g = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=24,
                         eos_token_id=stop, pad_token_id=tok.pad_token_id)
    manager = model.init_continuous_batching(generation_config=g, continuous_batching_config=cb)
    manager.start()
    try:
        def run(prompt):
            rid = manager.add_request(prompt, max_new_tokens=24)
            result = manager.get_result(rid, timeout=60)
            while not result.is_finished():
                result = manager.get_result(rid, timeout=60)
            return result

        first = run(prompts[0])
        obs = tok.encode("<|im_start|>user\n<tool_response>\n1234\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n", add_special_tokens=False)
        second = prompts[0] + first.generated_tokens + obs
        print(f"turn 1: prompt {len(prompts[0])} + generated {len(first.generated_tokens)}; "
              f"turn 2 prompt {len(second)} tokens")
        run(second)
    finally:
        manager.stop(block=True, timeout=10)


if __name__ == "__main__":
    main()
