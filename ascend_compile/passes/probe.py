"""Workspace sizes from a device's workspace query, probed at compile time over a set of lengths.

Where a kernel's workspace has no formula (Ascend's PA and FIA), the only source is a query that
answers for given host lengths. `ProbedWorkspaceNeed` is the `NeedFn` (see `workspaces.py`) that
asks it over a set of probe lengths, keeps the maximum over lengths (and, through the planner, over
layers and buckets), and records the length that needs it. The need is not assumed monotonic in
length, so the probe set covers every block-count class at both ends, not only the largest length.
Nothing here runs at replay.
"""
from __future__ import annotations

from typing import Callable, Sequence

from ..ops import tiling
from .workspaces import KernelSite, NodeNeed

#: Bytes a kernel needs: (kernel, shape, query tokens per sequence, KV length per sequence,
#: block-table width) -> bytes.
WorkspaceQuery = Callable[[str, tiling.AttentionShape, Sequence[int], Sequence[int], int], int]

#: The length vLLM-Ascend pinned PA's workspace to (SEQ_LEN_WITH_MAX_PA_WORKSPACE).
VLLM_ASCEND_PINNED_LEN = 6144


def default_probe_lengths(max_model_len: int, block_size: int) -> list[int]:
    """Every block-count class at both ends (`(n-1)*block_size + 1` and `n*block_size`: the first
    and last length with `n` blocks), every power of two, vLLM-Ascend's 6144 and `max_model_len`;
    ascending, within [1, max_model_len]."""
    lens = {1, max_model_len, VLLM_ASCEND_PINNED_LEN}
    for n in range(1, -(-max_model_len // block_size) + 1):
        lens.update(((n - 1) * block_size + 1, n * block_size))
    power = 1
    while power <= max_model_len:
        lens.add(power)
        power *= 2
    return sorted(n for n in lens if 1 <= n <= max_model_len)


class ProbedWorkspaceNeed:
    """A `NeedFn` that sizes a kernel node by asking `query` at each probe length.

    For a node in a graph of `tokens` query tokens (and as many, padded, sequences) it asks at each
    length `L`: every sequence decoding at `L` (PA and FIA) and, for FIA, one sequence holding all
    `tokens` query tokens at KV length `max(L, tokens)` with the others empty. The need is the
    largest answer; its length is the plan's arg-max. Answers are cached per (kernel, shape, tokens,
    layout, length), so the layers of one shape cost one probe set.

    `probe_lens`: the lengths to ask at; None for `default_probe_lengths`. `queries` counts the
    questions asked.
    """

    def __init__(self, query: WorkspaceQuery, probe_lens: Sequence[int] | None = None) -> None:
        if probe_lens is not None:
            probe_lens = sorted(set(probe_lens))
            if not probe_lens or any(not isinstance(n, int) or n < 1 for n in probe_lens):
                raise ValueError(f"workspace_probe_lens: expected positive int lengths, got {probe_lens!r}")
        self.query = query
        self.probe_lens = probe_lens
        self.queries = 0
        self._answers: dict[tuple, int] = {}

    def lengths(self, max_model_len: int, block_size: int) -> list[int]:
        """The lengths probed for graphs bounded by `max_model_len`."""
        if self.probe_lens is None:
            return default_probe_lengths(max_model_len, block_size)
        too_long = [n for n in self.probe_lens if n > max_model_len]
        if too_long:
            raise ValueError(f"workspace_probe_lens: lengths {too_long} exceed max_model_len={max_model_len}")
        return list(self.probe_lens)

    def __call__(self, site: KernelSite, tokens: int, max_model_len: int, pinned_seq_len: int | None) -> NodeNeed:
        lens = self.lengths(max_model_len, site.shape.block_size)
        needs = [self.need(site.kernel, site.shape, tokens, n, max_model_len) for n in lens]
        top = max(needs)
        exact, exact_len = top, lens[needs.index(top)]  # the shortest length with the largest need
        if pinned_seq_len is None:
            return NodeNeed(site.node, site.kernel, exact, exact_len, exact, exact_len)
        pinned = self.need(site.kernel, site.shape, tokens, pinned_seq_len, max_model_len)
        if pinned > exact:
            exact, exact_len = pinned, pinned_seq_len
        return NodeNeed(site.node, site.kernel, pinned, pinned_seq_len, exact, exact_len)

    def need(self, kernel: str, shape: tiling.AttentionShape, tokens: int, seq_len: int, max_model_len: int) -> int:
        """Bytes `kernel` needs in a graph of `tokens` query tokens at probe length `seq_len`."""
        layouts = [("decode", [1] * tokens, [seq_len] * tokens)]
        if kernel == tiling.FIA and tokens > 1 and max(seq_len, tokens) <= max_model_len:
            empty = [0] * (tokens - 1)
            layouts.append(("chunk", [tokens] + empty, [max(seq_len, tokens)] + empty))
        max_blocks = -(-max_model_len // shape.block_size)
        best = 0
        for layout, query_lens, kv_lens in layouts:
            key = (kernel, shape, tokens, layout, seq_len, max_blocks)
            if key not in self._answers:
                self.queries += 1
                self._answers[key] = int(self.query(kernel, shape, query_lens, kv_lens, max_blocks))
            best = max(best, self._answers[key])
        return best
