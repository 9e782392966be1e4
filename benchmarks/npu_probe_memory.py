"""Compile-time workspace sizing on the NPU target: device bytes and workspace queries, before and after
issue 22 (FIA and PA asked once per graph, probe caches of a few blocks).

    python benchmarks/npu_probe_memory.py [--max-model-len 8192 32768 131072] [--layers 32] [--json]

For a model of `--layers` attention layers (32 query heads, 8 KV heads of 128, bf16, KV-cache blocks of
128) with the default buckets (1, 2, 4, 8, ..., 256) and kernel policy (PA up to batch 16, FIA above
and for mixed steps), at each `max_model_len`:

- **before**: the probe of commit af5a0cb, *replayed analytically* (running it is not possible: it
  would allocate 64 GiB at 128k): the same questions in the same order (every probe length, PA and FIA
  in the decode layout, FIA also with one sequence holding the bucket's tokens), each costing what
  that probe allocated on the device: its cache of one block per sequence's block, kept per shape at
  the largest asked (old and new alive while it grows), the block table's device copy, the query, the
  output, and the answer (the fake's sizes: PA uint8 bytes, FIA in the query's dtype);
- **after**: the NPU target's sizing *measured* on the fake torch_npu (`tests/npu_probe_cost.py`:
  every op output allocated during the planning, answers included), and the queries it asked.

Bytes are the peak alive at once. The layers share one shape, so both ask per graph, not per layer.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ascend_compile.config import default_capture_sizes  # noqa: E402
from ascend_compile.ops import tiling  # noqa: E402
from ascend_compile.ops.features import PLAIN  # noqa: E402
from ascend_compile.ops.kernel_policy import KernelPolicy  # noqa: E402
from ascend_compile.passes.pipeline import bucket_choices  # noqa: E402
from ascend_compile.passes.select_kernels import AttentionLayer  # noqa: E402
from tests import fake_torch_npu  # noqa: E402
from tests.npu_probe_cost import SHAPE, probe_cost  # noqa: E402

BF16 = 2  # bytes per element


def old_probe_lengths(max_model_len: int, block_size: int) -> list[int]:
    """The lengths the af5a0cb probe asked PA and FIA at: every block-count class at both ends, every
    power of two, 6144 and `max_model_len`, within [1, max_model_len]."""
    lens = {1, max_model_len, 6144}
    for n in range(1, -(-max_model_len // block_size) + 1):
        lens.update(((n - 1) * block_size + 1, n * block_size))
    lens.update(1 << p for p in range(max_model_len.bit_length()))
    return sorted(n for n in lens if 1 <= n <= max_model_len)


def old_probe_cost(max_model_len: int, layers: int) -> dict[str, int]:
    """The af5a0cb probe's questions and peak device bytes, replayed without allocating."""
    shape, bs = SHAPE, SHAPE.block_size
    max_blocks = -(-max_model_len // bs)
    block_bytes = bs * shape.num_kv_heads * shape.head_dim * BF16
    token_bytes = shape.num_heads * shape.head_dim * BF16
    choices = bucket_choices([AttentionLayer(shape, PLAIN)] * layers, default_capture_sizes(), KernelPolicy())
    asked: set[tuple] = set()
    queries = {tiling.PA: 0, tiling.FIA: 0}
    cache_blocks = peak = 0
    lens = old_probe_lengths(max_model_len, bs)
    for key, chosen in choices.items():
        tokens, kernel = key.bucket, chosen[0].kernel  # every layer: this kernel and shape (answers cached)
        for n in lens:
            layouts = [("decode", [1] * tokens, [n] * tokens)]
            if kernel == tiling.FIA and tokens > 1 and max(n, tokens) <= max_model_len:
                layouts.append(("chunk", [tokens] + [0] * (tokens - 1), [max(n, tokens)] + [0] * (tokens - 1)))
            for layout, query_lens, kv_lens in layouts:
                if (kernel, tokens, layout, n) in asked:
                    continue
                asked.add((kernel, tokens, layout, n))
                queries[kernel] += 1
                blocks = max(sum(-(-kv // bs) for kv in kv_lens), 1)
                grown = cache_blocks if blocks > cache_blocks else 0  # the old cache, alive while the new is made
                cache_blocks = max(cache_blocks, blocks)
                answer = tiling.workspace_nbytes(kernel, shape, kv_lens, query_lens)
                transient = (len(kv_lens) * max_blocks * 4 + 2 * sum(query_lens) * token_bytes + answer)
                peak = max(peak, (cache_blocks + grown) * block_bytes, cache_blocks * block_bytes + transient)
    kernels = [chosen[0].kernel for chosen in choices.values()]
    return {"pa_graphs": kernels.count(tiling.PA), "fia_graphs": kernels.count(tiling.FIA),
            "pa_queries": queries[tiling.PA], "fia_queries": queries[tiling.FIA], "peak_bytes": peak}


def new_probe_cost(max_model_len: int, layers: int) -> dict[str, int]:
    """The NPU target's sizing, measured on the fake torch_npu."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        fake = fake_torch_npu.install(monkeypatch)
        cost = probe_cost(fake, max_model_len, layers, SHAPE, torch.bfloat16)
    return {"pa_graphs": cost.pa_graphs, "fia_graphs": cost.fia_graphs, "pa_queries": cost.pa_queries,
            "fia_queries": cost.fia_queries, "peak_bytes": cost.peak_bytes}


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):,.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-model-len", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for max_model_len in args.max_model_len:
        for probe, cost in (("before (replayed)", old_probe_cost), ("after (fake NPU)", new_probe_cost)):
            rows.append({"max_model_len": max_model_len, "probe": probe, **cost(max_model_len, args.layers)})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"default buckets, {args.layers} layers of H=32 KVH=8 D=128 bf16, block 128")
    print("| max_model_len | probe | PA graphs | PA queries (per graph) | FIA graphs | FIA queries (per graph) "
          "| peak device bytes |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['max_model_len']} | {r['probe']} | {r['pa_graphs']} | {r['pa_queries']} "
              f"({r['pa_queries'] / r['pa_graphs']:.0f}) | {r['fia_graphs']} | {r['fia_queries']} "
              f"({r['fia_queries'] / r['fia_graphs']:.0f}) | {_mib(r['peak_bytes'])} |")


if __name__ == "__main__":
    main()
