"""Pieces captured on the live values of the step they are captured for (`lowering/piecewise_live.py`,
issue 46 item 11): an in-place op in a piece reading an index an earlier piece made, as vLLM's grouped
top-k routing does (`group_mask = zeros_like(...); group_mask.scatter_(1, group_idx, 1)`), here around
the example Llama's attention, which runs between pieces. Captured on nothing but buffers, the later
piece's capture read what the earlier capture left in `group_idx` (the simulator's poison, -1): "index
-1 is out of bounds"."""
from __future__ import annotations

import torch

from ascend_compile.passes.split_pieces import EagerNode
from examples import llama
from examples.llama import PagedBatch
from tests.test_failed_steps import assert_close, caches
from tests.test_piecewise import _compile, _llama

_ATTEND = llama.Attention.attend


def _routed_attend(self, q, k, v, block_table, seq_lens, query_start_loc, slot_mapping):
    """The attention, each token's output doubled on its head of largest query norm: the head chosen
    before the attention kernel (an earlier piece), the mask built in place after it (a later piece)."""
    group_idx = q.float().abs().sum(-1).topk(1, dim=-1).indices  # [T, 1]
    out = _ATTEND(self, q, k, v, block_table, seq_lens, query_start_loc, slot_mapping)
    group_mask = torch.zeros(out.shape[0], out.shape[1], dtype=out.dtype, device=out.device)
    group_mask.scatter_(1, group_idx, 1.0)
    return out * (1 + group_mask.unsqueeze(-1))


def test_an_in_place_scatter_of_an_earlier_pieces_index_is_captured_on_the_steps_values(monkeypatch):
    """Steps above the buckets (4, 8), prefill and mixed, served on pieces, each equal to eager (every KV
    cache too); the in-place scatter sits in a piece after the attention kernel, reading the index the
    piece before it made."""
    monkeypatch.setattr(llama.Attention, "attend", _routed_attend)
    cfg, model, reference = _llama()
    fn, artifacts = _compile(model, runtime="sim")
    batch = PagedBatch(cfg, seed=4)
    steps = [([40], [40]), ([60, 7, 9], [20, 1, 1]), ([5, 6], None), ([100, 30], [33, 30]), ([70, 8], [9, 2])]
    with torch.no_grad():
        for lens, qlens in steps:
            inputs = batch.step(lens, qlens)
            assert_close(fn(**inputs), reference(**inputs))
    for got, want in zip(caches(model), caches(reference), strict=True):
        assert_close(got, want)
    art = artifacts[-1]
    assert art.stats["piecewise_steps"] == 4 and art.stats["eager_fallbacks"] == 0, art.stats
    graph = next(iter(art.piecewise.values()))
    where = {n.name: i for i, p in enumerate(graph.pieces) for n in p.gm.graph.nodes}
    scatters = [name for name in where if name.startswith("scatter_")]
    assert scatters and all(where[s] > 0 for s in scatters), where  # in a piece after the first



class _Accumulates(torch.nn.Module):
    """The example model, also adding its logits into a buffer the caller passes: a write into a caller's
    tensor (not a KV cache) that is not idempotent, run twice it adds twice."""

    def __init__(self, cfg):
        super().__init__()
        self.model = llama.build(cfg)

    def forward(self, out, **inputs):
        logits = self.model(**inputs)
        out.add_(logits)
        return logits


def test_a_node_writing_a_callers_tensor_runs_once_per_step_not_in_the_capture_too():
    """`out.add_(logits)` runs between pieces (`split_pieces`: it writes graph input storage,
    `EagerNode.writes_caller`); the capture on the step's values skips it, so each step (two of them
    capturing their piecewise size) adds its logits once, as eager does."""
    cfg, _, _ = _llama()
    model, reference = _Accumulates(cfg), _Accumulates(cfg)
    fn, artifacts = _compile(model, runtime="sim")
    batch = PagedBatch(cfg, seed=4)
    with torch.no_grad():
        for lens, qlens in ([40], [40]), ([60, 7, 9], [20, 1, 1]), ([100, 30], [33, 30]):
            inputs = batch.step(lens, qlens)
            got = torch.ones(inputs["input_ids"].shape[0], cfg.vocab_size)
            want = got.clone()
            assert_close(fn(out=got, **inputs), reference(out=want, **inputs))
            assert_close(got, want)
    art = artifacts[-1]
    assert art.stats["piecewise_steps"] == 3 and art.stats["piecewise_captures"] == 2, art.stats
    segments = next(iter(art.piecewise.values())).segments
    eager = {s.node.name: s.writes_caller for s in segments if isinstance(s, EagerNode)}
    assert sorted(n for n, writes in eager.items() if writes) == ["add_"], eager  # not the attention kernels
