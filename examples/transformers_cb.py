"""transformers' continuous batching through `ascend_graph` on the CPU: a tiny random Llama, a few
prompts of mixed lengths, `generate_batch` plain and compiled, tokens/s of each and the artifacts'
stats. Run: `python -m examples.transformers_cb` (needs `pip install -e ".[transformers]"`)."""
from __future__ import annotations

import argparse
import collections
import time

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM

from ascend_compile.integrations import transformers as ac_hf


def run(model, prompts, generation, cb_config) -> tuple[list[list[int]], float]:
    """Generated tokens per prompt, and the wall time of `generate_batch`."""
    start = time.perf_counter()
    outputs = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=cb_config)
    seconds = time.perf_counter() - start
    ordered = [outputs[k] for k in sorted(outputs, key=lambda k: int(k.rsplit("_", 1)[-1]))]
    return [o.generated_tokens for o in ordered], seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--max-batch-tokens", type=int, default=32)
    parser.add_argument("--dispatch", choices=("dynamo", "direct"), default="dynamo",
                        help="ascend_compile.compile's dispatch for the runner's step")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512)).eval()
    prompts = [[1 + (i * 13 + j * 7) % 500 for j in range(5 + 9 * i % 40)] for i in range(args.prompts)]
    generation = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb = dict(page_size=16, num_blocks=256, max_batch_tokens=args.max_batch_tokens)
    total = args.prompts * args.new_tokens

    plain_tokens, plain_s = run(model, prompts, generation, ContinuousBatchingConfig(**cb))
    artifacts = []
    config = ac_hf.continuous_batching(model, ContinuousBatchingConfig(**cb), on_compiled=artifacts.append,
                                       capture_sizes=[1, 2, 4, 8, 16, 32, 64], dispatch=args.dispatch)
    first_tokens, first_s = run(model, prompts, generation, config)
    compiled_tokens, compiled_s = run(model, prompts, generation, config)
    stats = sum((a.stats for a in artifacts), start=collections.Counter())
    print(f"plain continuous batching:    {total / plain_s:8.1f} tokens/s ({plain_s:.2f} s)")
    print(f"ascend_graph, first run:      {total / first_s:8.1f} tokens/s ({first_s:.2f} s, compiles and captures)")
    print(f"ascend_graph, second run:     {total / compiled_s:8.1f} tokens/s ({compiled_s:.2f} s)  "
          f"x{plain_s / compiled_s:.2f} vs plain")
    print(f"dynamo graphs: {len(artifacts)}; stats: {dict(stats)}")
    same = plain_tokens == first_tokens == compiled_tokens
    print("tokens equal to plain continuous batching:", same)
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
