"""The mutants issue 36's mutation audit found the suite blind to, each now caught by what a user
sees: eager equality, a step served eagerly or replayed, the exact refusal. `tools/mutants.py` puts
each back (the block headed "issue 36") and requires it caught. The simulator's, the random
generators' and the vLLM binding's are beside their subjects (`test_sim.py`, `test_rng.py`,
`test_vllm.py`)."""
from __future__ import annotations

import torch

from ascend_compile.ops import tiling
from tests.test_npu import CASE1_CFG, CASE1_OPTIONS, assert_all_close, fake_npu, run_model  # noqa: F401 (a fixture)
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


# ------------------------------------------------ PA's per-step workspace check, bucket by bucket


def test_each_pa_step_is_checked_against_the_slot_of_its_own_graph(fake_npu):
    """With `share_workspace=False` each bucket's graph has its own slot, sized at PA's capture length:
    1,632 bytes for bucket 2, 3,264 for bucket 4. Two sequences of 1,281 need 3,264: more than their
    graph's slot, so that step runs eagerly; three sequences needing 3,264 fit bucket 4's slot and
    replay (neither is held to the other bucket's slot)."""
    steps = ([100, 200, 300], [1281, 1281], [1281, 1281, 100], [300, 400])
    options = dict(CASE1_OPTIONS, capture_sizes=(2, 4))
    results, artifacts = run_model(steps, CASE1_CFG, share_workspace=False, sim_overflow="raise", **options)
    assert_all_close(results)
    plan = artifacts[-1].rewritten.plan
    shape = tiling.AttentionShape(num_heads=4, num_kv_heads=2, head_dim=16, block_size=128)
    assert [plan.slots[f"attn_workspace_b{b}.decode"].nbytes for b in (2, 4)] == [1632, 3264]
    assert tiling.workspace_nbytes(tiling.PA, shape, [1281, 1281]) == 3264
    assert tiling.workspace_nbytes(tiling.PA, shape, [1281, 1281, 100, 1]) == 3264
    stats = artifacts[-1].stats
    assert (stats["eager_fallbacks"], stats["replays"]) == (1, 2)


def test_pa_is_asked_at_each_step_with_tables_as_wide_as_max_model_len_rounded_up(fake_npu):
    """max_model_len 8000 takes 63 blocks of 128 (8064 tokens; 62 hold only 7936): PA's per-step
    question is asked with 63-block tables, which hold the steps' sequences of up to 8000, and each
    step (its slot sized at 8000) replays, equal to eager."""
    steps = ([8000, 7990, 7000, 6500], [7950, 7000, 6200, 8000], [6145, 6145, 7999, 7937])
    options = dict(CASE1_OPTIONS, max_model_len=8000, workspace_probe_lens=[8000])
    results, artifacts = run_model(steps, CASE1_CFG, **options)
    assert_all_close(results)
    assert sum(a.stats["replays"] for a in artifacts) == 3 and sum(a.stats["eager_fallbacks"] for a in artifacts) == 0
