"""Workspace sizes from a device's workspace queries, asked at compile time the way each answers.

Where a kernel's workspace has no formula (Ascend's PA and FIA), the only source is the device's
query, and the two kernels' queries answer different questions (`ops/npu/workspace_queries.py`):

- FIA's `get_max_workspace` answers the most any lengths up to the shapes given can need: it is asked
  once per graph (per bucket and shape), like torch_npu's own ACL-graph capture and vLLM-Ascend ask it.
  Its answer covers every length, so a pinned `workspace_seq_len` does not shrink it, and the plan
  records `max_model_len` as its length.
- MLA's (FIA v2's) `get_max_workspace` is FIA's question for the MLA form, asked once per graph the
  same way, with the most query tokens a sequence of that graph may have (a decode graph's calls and
  a mixed graph's take different sparse modes, `ops/npu/mla.py`).
- PA's `get_workspace` answers for the lengths given, and that need is not assumed monotonic in
  length (vLLM-Ascend's worry: "smaller seq_lens might encounter a bigger workspace"), nor in the
  mix of lengths of a batch. No set of questions asked at compile time covers every step, so PA is
  asked once per graph, as vLLM-Ascend asks it when capturing: every sequence of the bucket decoding
  at the length PA graphs are captured at (its SEQ_LEN_WITH_MAX_PA_WORKSPACE, 6144, or max_model_len
  if shorter), and each step's own lengths are asked again before the replay (vLLM-Ascend at HEAD
  asks at every update, `vllm_ascend/attention/utils.py`): a step needing more than the slot runs
  eagerly (`npu_checks.pa_workspace_guard`, option `pa_workspace_check`). `workspace_probe_lens`
  asks PA at every length given instead, keeping the largest answer.

`ProbedWorkspaceNeed` is the `NeedFn` (see `workspaces.py`) doing this; answers are cached per
(kernel, shape, tokens, length, table width; FIA's per layer features too: a window or sinks change the
call asked about, `ops/npu/features.py`), so the layers of one shape cost one question each.
Nothing here runs at replay.
"""
from __future__ import annotations

import collections
from typing import Callable, Protocol, Sequence

from .. import ledger, plan_cache
from ..ops import tiling
from ..ops.features import AttentionFeatures
from .workspaces import KernelSite, NodeNeed

#: The length vLLM-Ascend pinned PA's workspace to (SEQ_LEN_WITH_MAX_PA_WORKSPACE), and PA graphs
#: are captured at (`lowering/inputs.py: PA_CAPTURE_SEQ_LEN`).
VLLM_ASCEND_PINNED_LEN = 6144


class WorkspaceQueries(Protocol):
    """A device's workspace queries, in bytes (`ops.npu.workspace_queries.NpuWorkspaceQuery` on torch_npu)."""

    def paged_attention(self, shape: tiling.AttentionShape, context_lens: Sequence[int], max_blocks: int) -> int:
        """PA's need for one decode token per sequence at `context_lens`."""

    def fused_infer_attention_max(self, shape: tiling.AttentionShape, tokens: int, max_blocks: int,
                                  features: AttentionFeatures) -> int:
        """FIA's largest need for `tokens` query tokens in as many sequences, at any lengths, for a layer
        of `features` (a device asks it in the form that layer's calls take)."""

    def mla_max(self, shape: tiling.AttentionShape, tokens: int, max_blocks: int, max_query_len: int) -> int:
        """MLA's largest need for `tokens` query tokens in as many sequences of at most `max_query_len`."""


class ProbedWorkspaceNeed:
    """A `NeedFn` sizing each kernel node from the device's workspace queries (see the module docstring).

    `probe_lens`: the lengths PA is asked at; None for PA's capture length only (see the module
    docstring). `queries` counts the questions asked, per kernel.
    """

    def __init__(self, queries: WorkspaceQueries, probe_lens: Sequence[int] | None = None) -> None:
        if probe_lens is not None:
            probe_lens = sorted(set(probe_lens))
            if not probe_lens or any(not isinstance(n, int) or n < 1 for n in probe_lens):
                raise ValueError(f"workspace_probe_lens: expected positive int lengths, got {probe_lens!r}")
        self.device_queries = queries
        self.probe_lens = probe_lens
        self.queries: collections.Counter[str] = collections.Counter()
        self._answers: dict[tuple, int] = {}

    def lengths(self, max_model_len: int) -> list[int]:
        """The lengths PA is asked at for graphs bounded by `max_model_len`."""
        if self.probe_lens is None:
            return [min(VLLM_ASCEND_PINNED_LEN, max_model_len)]
        too_long = [n for n in self.probe_lens if n > max_model_len]
        if too_long:
            raise ValueError(f"workspace_probe_lens: lengths {too_long} exceed max_model_len={max_model_len}")
        return list(self.probe_lens)

    def __call__(self, site: KernelSite, tokens: int, max_model_len: int, pinned_seq_len: int | None) -> NodeNeed:
        max_blocks = -(-max_model_len // site.shape.block_size)
        if site.kernel == tiling.FIA:
            nbytes = self._ask((tiling.FIA, site.shape, tokens, max_blocks, site.features),
                               lambda: self.device_queries.fused_infer_attention_max(site.shape, tokens, max_blocks,
                                                                                      site.features))
            return NodeNeed(site.node, site.kernel, nbytes, max_model_len, nbytes, max_model_len)
        if site.kernel == tiling.MLA:
            query_len = site.max_query_len or tokens
            nbytes = self._ask((tiling.MLA, site.shape, tokens, max_blocks, query_len), lambda: self.device_queries.mla_max(
                site.shape, tokens, max_blocks, query_len))
            return NodeNeed(site.node, site.kernel, nbytes, max_model_len, nbytes, max_model_len)
        lens = self.lengths(max_model_len)
        needs = [self.pa_need(site.shape, tokens, n, max_blocks) for n in lens]
        top = max(needs)
        exact, exact_len = top, lens[needs.index(top)]  # the shortest length with the largest need
        if pinned_seq_len is None:
            return NodeNeed(site.node, site.kernel, exact, exact_len, exact, exact_len)
        pinned = self.pa_need(site.shape, tokens, pinned_seq_len, max_blocks)
        if pinned > exact:
            exact, exact_len = pinned, pinned_seq_len
        return NodeNeed(site.node, site.kernel, pinned, pinned_seq_len, exact, exact_len)

    def pa_need(self, shape: tiling.AttentionShape, tokens: int, seq_len: int, max_blocks: int) -> int:
        """Bytes PA needs with `tokens` sequences decoding at `seq_len`."""
        return self._ask((tiling.PA, shape, tokens, seq_len, max_blocks), lambda: self.device_queries.paged_attention(
            shape, [seq_len] * tokens, max_blocks))

    @plan_cache.remembered("workspace_queries", question=lambda self, key, query: key)
    @ledger.timed("probes")
    def _ask(self, key: tuple, query: Callable[[], int]) -> int:
        if key not in self._answers:
            self.queries[key[0]] += 1
            self._answers[key] = int(query())
        return self._answers[key]
