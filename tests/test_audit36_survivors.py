"""The mutants issue 36's mutation audit found the suite blind to, each now caught by what a user
sees: eager equality, a step served eagerly or replayed, the exact refusal. `tools/mutants.py` puts
each back (the block headed "issue 36") and requires it caught. The simulator's, the random
generators' and the vLLM binding's are beside their subjects (`test_sim.py`, `test_rng.py`,
`test_vllm.py`)."""
from __future__ import annotations

import torch

from tests.test_runtime_graphs import BUF, CFG, Caller, TinyStep, compiled, dynamic_artifact

# ------------------------------------------------ a staged written input aliasing one used in place


class WritesBeforeAttending(TinyStep):
    """Writes each token's query into `buf` (a caller buffer, staged: batch data) before the
    attention reads the KV cache (used in place)."""

    def forward(self, ids, positions, block_table, seq_lens, query_start_loc, slot_mapping, buf):
        q = self.embed[ids.reshape(-1)].view(-1, CFG.num_heads, CFG.head_dim)
        buf[: q.shape[0]].copy_(q[:, 0])
        return self.logits(ids, positions, block_table, seq_lens, query_start_loc, slot_mapping)


def _rows_of_first_block(model: TinyStep, block_table: torch.Tensor) -> torch.Tensor:
    """`BUF` rows of `model`'s value cache from the first block of the step's first sequence on."""
    rows = model.value_cache.view(-1, CFG.head_dim)
    start = int(block_table[0, 0]) * CFG.block_size * CFG.num_kv_heads
    start = min(start, rows.shape[0] - BUF)
    return rows[start:start + BUF]


def test_a_staged_written_input_aliasing_the_kv_cache_runs_eagerly_and_equals_eager():
    """The caller's buffer is a view of the value cache, over blocks the step attends: eager's write
    lands in the cache before the attention reads it, a graph's would land in a static copy. The
    overlap of a staged input with one used in place sends the step to eager."""
    torch._dynamo.reset()
    model, reference = WritesBeforeAttending(), WritesBeforeAttending()
    fn, artifacts = compiled(model, dynamic=True)
    caller = Caller(0)
    with torch.no_grad():
        for size in (3, 5, 2, 4):
            inputs = caller.step(size)
            got = fn(**inputs, buf=_rows_of_first_block(model, inputs["block_table"]))
            expected = reference(**inputs, buf=_rows_of_first_block(reference, inputs["block_table"]))
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(model.value_cache, reference.value_cache, atol=1e-5, rtol=1e-5)
    art = dynamic_artifact(artifacts)
    assert art.stats["replays"] == 0 and art.stats["eager_fallbacks"] >= 3
    assert any("overlap in memory" in why for why in art._fallbacks_logged)
