"""torch_npu's workspace queries, asked the way the device answers them, on probe tensors that do not
grow with `max_model_len`. Used at compile time only (`passes/probe.py`); line numbers are of the
torch_npu 2.14.0 wheel's `torch_npu/_op_plugin_docs.py` and `torch_npu/op_plugin/atb/_atb_api_docs.py`.

**FIA: one question per graph, answered for every length.** `_npu_fused_infer_attention_score_get_max_workspace`
is documented as the query of the ACL-graph tiling-sink case: "获取最大workspace size" (it gets the
*maximum* workspace size, `_op_plugin_docs.py` L8436). In the kernel source (CANN ops-transformer,
unverified on a device) the aclnn `...V3GetMaxWorkspaceSize` replaces both length lists by arrays of
the same size without data (`FakeFiaActualSeqArrays`, `FakeArray` in `aclnn_fused_infer_attention_score_inner.cpp`),
which sends the tiling down its max path (`GetMaxWorkspaceFlag`, `CalcMaxWorkspaceSize` in
`fia_tiling_nonquant.cpp`: sized by the core count and head dim, not by any length). torch_npu's own
ACL-graph capture asks it once per op at capture, with the capture's arguments, and reuses the answer
at every replay (`torch_npu/npu/_npugraph_handlers/ifa_handler.py`, `prepare_capture`); vLLM-Ascend
does the same with its capture's dummy lengths (`vllm_ascend/attention/attention_v1.py`). So FIA is
asked once per graph with that graph's shapes: `tokens` query tokens, a block table as wide as the runner's.
Its length values are placeholders the device does not read (the stand-in arrays keep only the lists' sizes);
the ones sent are the smallest the docs accept: the tokens packed into as few sequences as the table allows,
each its query length as KV length, and no empty sequence (the lists' sizes the kernel does check, at most 4096
entries: `npu_rules.TND_MAX_SEQUENCES`; the graph's own calls may hold `tokens` sequences, so a graph above
that is refused before the question). A call whose every sequence has one query token (a decode step) is another
form to the tiling: the older source's TND tiling then holds a whole head group per block, up to G times the matmul
share of the same tokens packed (hicann/ops-transformer c29bc106 `prompt_flash_attention_tiling.cpp` L5027-5043,
L3101-3107, L5068-5073). Its max path keeps only the lists' sizes, which tell that form apart (as many sequences as
tokens, none empty), though no source read here shows it doing so (c29bc106's PFA tiling even refuses data-less TND
lengths, L4269-4271). So FIA is asked a second time in that form, `tokens` sequences of one query token (one key in
the first, none in the others: one probe block), and the larger answer sizes the graph, whichever the device reads;
a windowed layer's in band mode only where the device's S=1 band probe found the band applied at one query token
(elsewhere its calls there are made without it: `NpuKernels.fused_infer_attention`). "blocknum不能小于...的block数量之和" (L8220) is met by
`ceil(tokens / block_size)` blocks, so the probe cache is a few blocks, not `bucket * max_model_len / block_size`.

**MLA: FIA v2's query, likewise once per graph.** `_npu_fused_infer_attention_score_v2_get_max_workspace`
"获取最大workspace size" (L8961) for FIA v2 (`ops/npu/mla.py`), whose MLA form takes 1-16 query tokens per
sequence (L8724) and a sparse mode the project sets by them (`npu_rules.mla_sparse_mode`; L8697, though TND
takes 0 or 3 at any query lengths, L8719): the probe's sequences hold at most as many query
tokens as the graph's may (1 in a decode graph, so its question is asked in the decode graph's mode),
packed the same way. Its query tensors are sized by what the answer depends on: the later kernel source's max path
for this form reads no length nor token count, only the core count (hicann/ops-transformer 359e786a
`op_host/arch22/fia_tiling_nonquant_mla.cpp`, `CalcMaxWorkspaceSize`, `CalcMaxMmResSize`), while the older routes
it elsewhere (not read). So a graph above `MLA_PROBE_TOKENS` tokens is first asked at one sequence and at
`MLA_PROBE_TOKENS`: equal answers (a device whose answer reads no token count) answer every size, and no probe
tensor grows with the graph (a piecewise 4096 would be `q_nope [4096, H, 512]`, 512 MiB at H 128, allocated after
vLLM sized its KV cache); different ones are asked at the graph's own tokens.

**PA: asked at each length it will be sized for.** ATB's `_npu_paged_attention_get_workspace` answers
for the `context_lens` it is given: vLLM-Ascend captures PA at a pinned length because it "only returns
max workspace with specific seq_lens" (`vllm_ascend/worker/model_runner_v1.py`), so `passes/probe.py`
asks it at every probe length. PA's docs constrain block ids only ("block_tables中元素的值须在
[0, num_blocks)之间", `_atb_api_docs.py` L277), not blocks per sequence, so every row of its probe block
table names the probe cache's one block.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from .. import tiling
from . import band_probe as npu_band_probe
from . import rules as npu_rules
from ..features import PLAIN, AttentionFeatures
from .kernels import NpuKernels
from ..tiling import AttentionShape

#: The most query tokens MLA's probe tensors hold where the device's answer reads no token count (`mla_max`).
MLA_PROBE_TOKENS = 128


def fia_probe_lengths(tokens: int, kv_capacity: int) -> tuple[list[int], list[int]]:
    """Query and KV lengths of the fewest sequences holding `tokens` query tokens, at most `kv_capacity`
    each (every KV length its query length): only non-empty sequences, so a probe's lists stay far below
    the kernel's 4096 entries (`npu_rules.TND_MAX_SEQUENCES`) whatever the graph's size."""
    if tokens < 1 or kv_capacity < 1:
        raise ValueError(f"tokens: expected at least one query token and a KV capacity of at least 1, got {tokens} "
                         f"tokens and {kv_capacity}")
    full, rest = divmod(tokens, kv_capacity)
    query_lens = [kv_capacity] * full + ([rest] if rest else [])
    return query_lens, list(query_lens)


def fia_decode_kv_lens(tokens: int) -> list[int]:
    """KV lengths of the one-query-token question's `tokens` sequences: one key in the first, none in the others (the
    max path reads the lists' sizes, not their values, and KV lengths below the query's are accepted), so its probe
    cache is one block however many sequences the graph's decode steps hold."""
    return [1] + [0] * (tokens - 1)


class NpuWorkspaceQuery:
    """Asks torch_npu's workspace queries on probe tensors of a given dtype (a `passes.probe.WorkspaceQueries`)."""

    def __init__(self, kernels: NpuKernels, dtype: torch.dtype) -> None:
        self.kernels = kernels
        self.dtype = dtype
        self._mla: dict[tuple, int] = {}  # MLA's answers, by (shape, tokens, table width, query length)

    def paged_attention(self, shape: AttentionShape, context_lens: Sequence[int], max_blocks: int,
                        key_cache: torch.Tensor | None = None, value_cache: torch.Tensor | None = None,
                        block_table: torch.Tensor | None = None) -> int:
        """Bytes PA needs for one decode token per sequence at these lengths, asked with the caches and
        block table given (the kernel's own, at each step) or probe tensors in their place: block tables
        of `max_blocks` columns, all naming a one-block cache."""
        if block_table is None:
            block_table = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32, device=self.kernels.device)
        query = self._query(len(context_lens), shape)
        if key_cache is None or value_cache is None:
            key_cache = value_cache = self._cache(shape, 1)
        return self.kernels.workspace_nbytes(tiling.PA, query, key_cache, value_cache, block_table[:len(context_lens)],
                                             [], context_lens, shape.head_dim**-0.5,
                                             torch.empty_like(query))  # PA's query takes `out`

    def fused_infer_attention_max(self, shape: AttentionShape, tokens: int, max_blocks: int,
                                  features: AttentionFeatures = PLAIN) -> int:
        """Bytes FIA needs at most, for any lengths, in a graph of `tokens` query tokens and as many
        sequences with block tables of `max_blocks` columns, for a layer of `features`: asked in the form
        its calls take (band mode for a window, FIA v2's query with a probe `learnable_sink` for sinks),
        as vLLM-Ascend asks with its call's own arguments (`attention_v1.py`, `full_graph_fia(_v2)`)."""
        npu_rules.check_tnd_sequences(tokens)  # the graph's calls, unlike the probe's, may hold `tokens` sequences
        query_lens, kv_lens = fia_probe_lengths(tokens, max_blocks * shape.block_size)
        packed = self._fia_asked(shape, tokens, max_blocks, features, query_lens, kv_lens)
        if len(query_lens) == tokens:
            return packed  # the packed form is the one-query-token form already
        # ... and in the one-query-token form (a decode step's, `tokens` sequences), whose tiling may ask more
        return max(packed, self._fia_asked(shape, tokens, max_blocks, features, [1] * tokens, fia_decode_kv_lens(tokens)))

    def _fia_asked(self, shape: AttentionShape, tokens: int, max_blocks: int, features: AttentionFeatures,
                   query_lens: Sequence[int], kv_lens: Sequence[int]) -> int:
        if features.window is not None and all(q == 1 for q in query_lens) and \
                not self.kernels.band_at_single_query(npu_band_probe.form(shape, self.dtype, features.sinks)):
            features = dataclasses.replace(features, window=None)  # as the binding calls it: no band at S 1
        table, used = self._probe_table(max_blocks, kv_lens, shape.block_size)
        ends = torch.tensor(query_lens).cumsum(0).tolist()
        query = self._query(tokens, shape)
        cache = self._cache(shape, max(used, 1))
        sinks = torch.zeros(shape.num_heads, dtype=npu_rules.SINKS_DTYPE, device=self.kernels.device) \
            if features.sinks else None
        return self.kernels.workspace_nbytes(tiling.FIA, query, cache, cache, table, ends, kv_lens,
                                             shape.head_dim**-0.5, query,  # FIA's query takes no `out`
                                             window=features.window, sinks=sinks)

    def mla_max(self, shape: AttentionShape, tokens: int, max_blocks: int, max_query_len: int) -> int:
        """Bytes the MLA kernel needs at most, for any lengths, in a graph of `tokens` query tokens in as
        many sequences of at most `max_query_len` each (FIA v2 takes at most 16), tables of `max_blocks`."""
        query_len = min(max_query_len, npu_rules.MLA_MAX_QUERY_LEN, max_blocks * shape.block_size)
        npu_rules.check_mla_sequences(tokens)
        if tokens > MLA_PROBE_TOKENS:
            first = self._mla_asked(shape, query_len, max_blocks, query_len)
            if first == self._mla_asked(shape, MLA_PROBE_TOKENS, max_blocks, query_len):
                return first  # the device's answer reads no token count: the probe's tensors stay small
        return self._mla_asked(shape, tokens, max_blocks, query_len)

    def _mla_asked(self, shape: AttentionShape, tokens: int, max_blocks: int, query_len: int) -> int:
        """FIA v2's max-workspace answer for `tokens` query tokens in sequences of `query_len`, asked once."""
        key = (shape, tokens, max_blocks, query_len)
        if key not in self._mla:
            self._mla[key] = self._mla_ask(shape, tokens, max_blocks, query_len)
        return self._mla[key]

    def _mla_ask(self, shape: AttentionShape, tokens: int, max_blocks: int, query_len: int) -> int:
        query_lens, kv_lens = fia_probe_lengths(tokens, query_len)
        table, used = self._probe_table(max_blocks, kv_lens, shape.block_size)
        device = self.kernels.device
        q_nope = self._query(tokens, shape)
        q_pe = torch.empty(tokens, shape.num_heads, shape.rope_dim, dtype=self.dtype, device=device)
        blocks = (max(used, 1), shape.block_size)
        kv_c_cache = torch.empty(*blocks, shape.head_dim, dtype=self.dtype, device=device)
        k_pe_cache = torch.empty(*blocks, shape.rope_dim, dtype=self.dtype, device=device)
        ends = torch.tensor(query_lens).cumsum(0).tolist()
        return self.kernels.mla_workspace_nbytes(q_nope, q_pe, kv_c_cache, k_pe_cache, table, ends, kv_lens,
                                                 (shape.head_dim + shape.rope_dim)**-0.5)

    def _probe_table(self, max_blocks: int, kv_lens: Sequence[int], block_size: int) -> tuple[torch.Tensor, int]:
        """A block table of a row per sequence ("第一维长度需等于B", L8223), giving each blocks of its own for its KV
        length; and the blocks used."""
        table = torch.zeros(len(kv_lens), max_blocks, dtype=torch.int32, device=self.kernels.device)
        used = 0
        for row, n in enumerate(kv_lens):
            blocks = -(-n // block_size)
            table[row, :blocks] = torch.arange(used, used + blocks, dtype=torch.int32)
            used += blocks
        return table, used

    def _query(self, tokens: int, shape: AttentionShape) -> torch.Tensor:
        return torch.empty(tokens, shape.num_heads, shape.head_dim, dtype=self.dtype, device=self.kernels.device)

    def _cache(self, shape: AttentionShape, num_blocks: int) -> torch.Tensor:
        return torch.empty(num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim, dtype=self.dtype,
                           device=self.kernels.device)
