"""The mutants issue 36's mutation audit found the suite blind to, each now caught by what a user
sees: eager equality, a step served eagerly or replayed, the exact refusal. `tools/mutants.py` puts
each back (the block headed "issue 36") and requires it caught. The simulator's, the random
generators' and the vLLM binding's are beside their subjects (`test_sim.py`, `test_rng.py`,
`test_vllm.py`, `test_vllm_real.py`)."""
from __future__ import annotations

import dataclasses
import re

import pytest
import sympy
import torch

from ascend_compile.lowering.inputs import padded_copies
from ascend_compile.ops import tiling
from ascend_compile.passes import roles
from examples.deepseek import build as build_deepseek
from examples.llama import LlamaConfig, PagedBatch
from examples.llama import build as build_llama
from tests.test_backend import compiled_model
from tests.test_mla_npu import CFG as MLA_CFG
from tests.test_mla_npu import MAX_LEN as MLA_MAX_LEN
from tests.test_mla_npu import TOL as MLA_TOL
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


# ------------------------------------------------ a model mixing latent and plain attention on "npu"


class PlainAndLatent(torch.nn.Module):
    """A plain (GQA) decoder and a latent-attention one over the same step: PA/FIA and MLA kernels in
    one graph, both in the shapes torch_npu takes (bfloat16, blocks of 128, MLA's d 512 and rope 64)."""

    def __init__(self) -> None:
        super().__init__()
        self.plain = build_llama(LlamaConfig(num_layers=1, block_size=128, num_blocks=MLA_CFG.num_blocks,
                                             dtype=torch.bfloat16))
        self.latent = build_deepseek(dataclasses.replace(MLA_CFG, num_layers=1))

    def forward(self, **inputs):
        return self.plain(**inputs) + self.latent(**inputs)


def test_a_model_mixing_plain_and_latent_attention_packs_mixed_padding_into_dummies_mla_takes(fake_npu):
    """A graph with any MLA kernel packs a mixed step's padding into dummies of at most 16 query tokens
    (FIA v2's MLA form takes 1-16 per sequence), plain layers beside it or not: bucket 32's mixed graph
    is captured with two dummies of 16, and mixed steps padded by 27 or 26 tokens replay it, equal to
    eager (dummies of 128 would have MLA refuse the capture and serve every mixed step eagerly)."""
    fn, artifacts = compiled_model(PlainAndLatent(), runtime="npu", max_model_len=MLA_MAX_LEN, capture_sizes=(32,))
    reference = PlainAndLatent()
    batch = PagedBatch(MLA_CFG, seed=26, table_width=MLA_MAX_LEN // MLA_CFG.block_size)
    with torch.no_grad():
        for lens, qlens in (([40, 300, 7], [3, 1, 1]), ([100, 5, 600], None), ([600, 20], [4, 2])):
            inputs = batch.step(lens, qlens)
            torch.testing.assert_close(fn(**inputs), reference(**inputs), **MLA_TOL)
    assert sum(a.stats["replays"] for a in artifacts) == 3 and sum(a.stats["eager_fallbacks"] for a in artifacts) == 0
    graphs = artifacts[-1].describe()["graphs"]
    (mla,) = [e for e in graphs["b32.mixed"]["update_table"] if e["kernel"] == tiling.MLA]
    assert mla["frozen_at_capture"]["actual_seq_qlen"] == [16, 32]


# ------------------------------------------------ a block table that does not fit its graph


@pytest.mark.parametrize("shape, why", [
    ((8, 32), r"\(block_table has 8 rows, more than the graph's 4 sequences: it takes one row per sequence "
              r"of the step, as many as seq_lens has\)$"),
    ((4, 40), r"\(block_table is wider than max_model_len / block_size\)$"),
], ids=["rows", "width"])
def test_a_block_table_too_large_for_its_graph_is_refused_naming_what_is_too_large(shape, why):
    """A block table with more rows than the graph has sequences (a persistent buffer's view not cut
    to the step's requests) is not blamed on its width."""
    spec = roles.InputSpec(0, "vllm_block_table_0", roles.Role.BLOCK_TABLE, (sympy.Symbol("s0"), 32))
    with pytest.raises(ValueError, match=rf"^vllm_block_table_0: shape {re.escape(str(shape))} does not fit the "
                                         rf"graph's padded shape \(4, 32\) " + why):
        padded_copies(spec, shape, torch.zeros(4, 32, dtype=torch.int32), 3, 4)
