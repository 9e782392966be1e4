"""Phase 2 of the GPU check: the attention kernels' bandwidth against a device copy measured in
the same run, one row per case, each printed and written as soon as it is measured.

    python benchmarks/gpu_kernels.py --json OUT/kernels.json [--quick] [--budget-s 75]

Cases (bf16; H=16, KVH=8, D=128, block 128, the decode preset's attention):

- `copy`: a device-to-device copy of 1 GiB, read + write counted (the roofline's bandwidth);
- `pa`: the decode kernel (`paged_attention_dev`, split capacity from `gpu_splits`) at several
  batches x contexts; the issue's target is batch 64 x 4096 at >= 70% of the copy;
- `pa-uneven`: one 64K-token sequence among 63 of 1K, with the split capacity and with one split
  (no capacity: the long sequence runs alone in one program), to show the schedule rebalancing;
- `fia-decode`: FIA on the same decode step (what `select_kernels` picks above `pa_max_batch`);
- `fia-prefill`: one causal chunk of 4096 tokens, with the default 64-row query tiles and with the
  16-row tiles of before, against torch's SDPA (flash backend, `is_causal`) on contiguous K/V;
- `mla-decode`: the MLA kernel (`mla_fused_infer_attention_dev`, DeepSeek-V3 at TP 8: 16 heads on
  one latent head of 512 + 64 dims, block 64) at batch 64 x 4096 (and 8, 128 in the full run): its
  bytes are the latent cache read once for all heads, so its bandwidth compares with the copy's;
- `mla-prefill` (full run): a causal chunk of 1024 tokens through the absorbed MLA kernel.

Estimated time on an H200: ~18 Triton compiles of ~1-2 s each (fewer when phase 1 left them in
Triton's cache), every timed case well under a second, imports ~10 s: about 50 s. `--budget-s`
skips the cases left once the budget is spent. `--smoke` runs tiny cases on the CPU (the CPU tests
run the MLA case's call, `tests/test_triton_mla.py`).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ascend_compile.ops  # noqa: E402,F401
from ascend_compile.ops import cuda as cuda_ops  # noqa: E402
from ascend_compile.ops import tiling  # noqa: E402
from bench_util import Results, copy_bandwidth, nominal_gbps, synchronize, time_throughput  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 128
#: MLA's cases: DeepSeek-V3 at tensor parallelism 8 (128 / 8 heads), its latent and rope dims.
MLA_HEADS, MLA_LATENT, MLA_ROPE, MLA_BLOCK = 16, 512, 64, 64
MLA_SCALE = 192**-0.5  # DeepSeek-V3's query/key head dim: 128 + 64
DTYPE = torch.bfloat16
ITERS = 20


def shuffled_blocks(lens: list[int], block: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """A block table giving the sequences of `lens` their own blocks, in a shuffled order."""
    blocks = [-(-n // block) for n in lens]
    perm = torch.randperm(sum(blocks), generator=gen, device=device).to(torch.int32)
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32, device=device)
    start = 0
    for b, n in enumerate(blocks):
        table[b, :n] = perm[start:start + n]
        start += n
    return table


class Paged:
    """A paged KV cache holding `lens` (shuffled blocks), a decode query, and the device lengths."""

    def __init__(self, lens: list[int], device: torch.device, query_tokens: int | None = None) -> None:
        gen = torch.Generator(device=device).manual_seed(0)
        self.block_table = shuffled_blocks(lens, BLOCK, gen, device)
        cache = (sum(-(-n // BLOCK) for n in lens), BLOCK, KV_HEADS, HEAD_DIM)
        self.key_cache = torch.randn(cache, generator=gen, device=device, dtype=DTYPE)
        self.value_cache = torch.randn(cache, generator=gen, device=device, dtype=DTYPE)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        tokens = query_tokens if query_tokens is not None else len(lens)
        self.query = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen, device=device, dtype=DTYPE)
        self.out = torch.empty_like(self.query)
        self.kv_bytes = sum(lens) * 2 * KV_HEADS * HEAD_DIM * self.key_cache.element_size()
        self.bytes = self.kv_bytes + 2 * self.query.numel() * self.query.element_size()


def shape() -> tiling.AttentionShape:
    return tiling.AttentionShape(HEADS, KV_HEADS, HEAD_DIM, BLOCK)


def workspace(tokens: int, splits: int, device: torch.device) -> torch.Tensor:
    return torch.empty(cuda_ops.dev_workspace_nbytes(tokens, shape(), splits), dtype=torch.uint8, device=device)


def pa_call(p: Paged, splits: int, device: torch.device) -> Callable[[], Any]:
    ws = workspace(p.query.shape[0], splits, device)
    return functools.partial(torch.ops.ascend.paged_attention_dev, p.query, p.key_cache, p.value_cache,
                             p.block_table, p.seq_lens, HEAD_DIM**-0.5, ws, p.out, splits)


def fia_call(p: Paged, query_start_loc: torch.Tensor, splits: int, device: torch.device,
             **knobs: Any) -> Callable[[], Any]:
    ws = workspace(p.query.shape[0], splits, device)
    if knobs:  # tuning knobs: the Triton launcher itself
        from ascend_compile.ops import cuda_triton

        return functools.partial(cuda_triton.attention_dev, p.query, p.key_cache, p.value_cache, p.block_table,
                                 p.seq_lens, query_start_loc, HEAD_DIM**-0.5, ws, p.out, splits, **knobs)
    return functools.partial(torch.ops.ascend.fused_infer_attention_dev, p.query, p.key_cache, p.value_cache,
                             p.block_table, query_start_loc, p.seq_lens, HEAD_DIM**-0.5, ws, p.out, splits)


class LatentPaged:
    """A paged latent cache (MLA) holding `lens`, the absorbed queries of `query_lens` tokens per
    sequence (the last ones), and the device lengths."""

    def __init__(self, lens: list[int], query_lens: list[int], device: torch.device) -> None:
        gen = torch.Generator(device=device).manual_seed(0)
        self.block_table = shuffled_blocks(lens, MLA_BLOCK, gen, device)
        blocks = (sum(-(-n // MLA_BLOCK) for n in lens), MLA_BLOCK)
        self.kv_c_cache = torch.randn(*blocks, MLA_LATENT, generator=gen, device=device, dtype=DTYPE)
        self.k_pe_cache = torch.randn(*blocks, MLA_ROPE, generator=gen, device=device, dtype=DTYPE)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
        tokens = starts[-1]
        self.q_nope = torch.randn(tokens, MLA_HEADS, MLA_LATENT, generator=gen, device=device, dtype=DTYPE)
        self.q_pe = torch.randn(tokens, MLA_HEADS, MLA_ROPE, generator=gen, device=device, dtype=DTYPE)
        self.out = torch.empty_like(self.q_nope)
        size = self.kv_c_cache.element_size()
        self.bytes = sum(lens) * (MLA_LATENT + MLA_ROPE) * size + tokens * MLA_HEADS * (2 * MLA_LATENT + MLA_ROPE) * size
        # scores (latent + rope) and values per query row and key: causal chunks see half their own keys
        keys = sum(n - q + (q + 1) / 2 for n, q in zip(lens, query_lens))
        self.flops = 2 * MLA_HEADS * (2 * MLA_LATENT + MLA_ROPE) * keys * (tokens / len(lens))

    @staticmethod
    def shape() -> tiling.AttentionShape:
        return tiling.AttentionShape(MLA_HEADS, 1, MLA_LATENT, MLA_BLOCK, rope_dim=MLA_ROPE)

    def call(self, splits: int) -> Callable[[], Any]:
        ws = torch.empty(cuda_ops.dev_workspace_nbytes(self.q_nope.shape[0], self.shape(), splits), dtype=torch.uint8,
                         device=self.q_nope.device)
        return functools.partial(torch.ops.ascend.mla_fused_infer_attention_dev, self.q_nope, self.q_pe,
                                 self.kv_c_cache, self.k_pe_cache, self.block_table, self.query_start_loc,
                                 self.seq_lens, MLA_SCALE, ws, self.out, splits)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, help="write the rows here, rewritten after each")
    parser.add_argument("--quick", action="store_true", help="only the copy and the target case")
    parser.add_argument("--budget-s", type=float, default=None, help="skip the cases left after this many seconds")
    parser.add_argument("--smoke", action="store_true",
                        help="the script's own check on the CPU: tiny cases, reference kernels and Triton's "
                             "interpreter (run with TRITON_INTERPRET=1); its figures mean nothing")
    args = parser.parse_args(argv)
    if args.smoke:
        global ITERS
        ITERS = 2
        device, sms = torch.device("cpu"), 4
        pa_cases, uneven, prefill = [(2, 256), (4, 128)], [512] + [16] * 3, 64
        mla_cases, mla_prefill = [(2, 300)], 32
    elif not torch.cuda.is_available():
        print("gpu_kernels: needs CUDA", file=sys.stderr)
        return 2
    else:
        device, sms = torch.device("cuda"), cuda_ops.device_sm_count(torch.device("cuda"))
        pa_cases = [(64, 4096)] if args.quick else [(64, 4096), (1, 4096), (8, 4096), (32, 4096), (128, 4096),
                                                      (256, 2048)]
        uneven, prefill = [65536] + [1024] * 63, 4096
        mla_cases = [(64, 4096)] if args.quick else [(64, 4096), (8, 4096), (128, 4096)]
        mla_prefill = 1024
    began = time.perf_counter()
    info = {"device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "sms": sms, "torch": torch.__version__,
            "dtype": str(DTYPE), "shape": vars(shape()), "nominal_gbps": nominal_gbps(device), "iters": ITERS}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        print("gpu_kernels: needs triton", file=sys.stderr)
        return 2
    results = Results(args.json, info)
    print(" ".join(f"{k}={v}" for k, v in info.items()), flush=True)

    copy = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (16 << 20)) / 1e9
    results.add({"case": "copy", "bytes": 2 << 30, "gbps": copy})
    print(f"copy: {copy:.0f} GB/s measured (nominal {info['nominal_gbps']} GB/s)", flush=True)

    def measure(case: str, call: Callable[[], Any], nbytes: int, flops: float | None = None, **fields: Any) -> None:
        if args.budget_s is not None and time.perf_counter() - began > args.budget_s:
            results.add({"case": case, **fields, "skipped": f"time budget of {args.budget_s:.0f} s spent"})
            print(f"{case} {fields}: skipped (time budget)", flush=True)
            return
        try:
            start = time.perf_counter()
            call()  # compile
            synchronize(device)
            first = time.perf_counter() - start
            seconds = time_throughput(call, device, ITERS)
        except Exception as err:  # one failing case must not cost the others
            results.add({"case": case, **fields, "error": f"{type(err).__name__}: {err}"[:500]})
            print(f"{case} {fields}: ERROR {type(err).__name__}: {err}", flush=True)
            return
        row = {"case": case, **fields, "ms": seconds * 1e3, "bytes": nbytes, "gbps": nbytes / seconds / 1e9,
               "of_copy": nbytes / seconds / 1e9 / copy, "first_call_s": first}
        if flops:
            row["tflops"] = flops / seconds / 1e12
        results.add(row)
        extra = f", {row['tflops']:.0f} TFLOP/s" if flops else ""
        print(f"{case:12} {' '.join(f'{k}={v}' for k, v in fields.items()):42} {row['ms']:8.3f} ms "
              f"{row['gbps']:6.0f} GB/s {row['of_copy']:5.0%} of copy{extra}", flush=True)

    for batch, context in pa_cases:
        p = Paged([context] * batch, device)
        splits = cuda_ops.gpu_splits(sms, context)(tiling.PA, shape(), batch)
        measure("pa", pa_call(p, splits, device), p.bytes, batch=batch, context=context, splits=splits)
        if (batch, context) == pa_cases[0]:
            loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
            fia_splits = cuda_ops.gpu_splits(sms, context)(tiling.FIA, shape(), batch)
            measure("fia-decode", fia_call(p, loc, fia_splits, device), p.bytes, batch=batch, context=context,
                    splits=fia_splits)
        del p
    for batch, context in mla_cases:
        m = LatentPaged([context] * batch, [1] * batch, device)
        splits = cuda_ops.gpu_splits(sms, context)(tiling.MLA, m.shape(), batch)
        measure("mla-decode", m.call(splits), m.bytes, m.flops, batch=batch, context=context, splits=splits)
        del m
    if args.quick:
        return 0

    p = Paged(uneven, device)
    splits = cuda_ops.gpu_splits(sms, uneven[0])(tiling.PA, shape(), len(uneven))
    for s in (splits, 1):
        measure("pa-uneven", pa_call(p, s, device), p.bytes, batch=len(uneven),
                context=f"{uneven[0]}+{len(uneven) - 1}x{uneven[1]}", splits=s)
    del p

    tokens = prefill
    p = Paged([tokens], device, query_tokens=tokens)
    loc = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    flops = 4 * HEADS * HEAD_DIM * tokens * tokens / 2  # causal: half the score matrix
    for rows in (64, 16):
        measure("fia-prefill", fia_call(p, loc, 1, device, tile_rows=rows), p.bytes, flops, tokens=tokens,
                tile_rows=rows)
    # the peer: FlashAttention through SDPA on contiguous [1, H, T, D] (KV heads expanded beforehand)
    q = p.query.transpose(0, 1).unsqueeze(0)
    k = torch.randn(1, HEADS, tokens, HEAD_DIM, device=device, dtype=DTYPE)
    v = torch.randn_like(k)
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa() -> None:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

        measure("sdpa-flash", sdpa, p.bytes, flops, tokens=tokens)
    except ImportError as err:
        results.add({"case": "sdpa-flash", "error": str(err)})
    del p, q, k, v
    m = LatentPaged([mla_prefill], [mla_prefill], device)
    measure("mla-prefill", m.call(1), m.bytes, m.flops, tokens=mla_prefill)
    results.set("elapsed_s", time.perf_counter() - began)
    print(f"gpu_kernels: {time.perf_counter() - began:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
