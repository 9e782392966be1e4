"""The bugs a mutation audit (issue 27) put into the code and the suite let through, each now caught by
what a user sees: eager equality, the exact workspace maximum, a refusal. `tools/mutants.py` puts each
back and requires it caught. The property tests below each cover the class the survivor belonged to:
a check run on one branch only, a limit tested on one side, a cache keyed by part of what it depends on.
"""
from __future__ import annotations

import random

import pytest
import sympy
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_compile.config import CompileConfig
from ascend_compile.ops import tiling
from ascend_compile.passes import roles
from ascend_compile.passes.write_back import overlapping_writes
from examples.llama import LlamaConfig, PagedBatch, build
from tests.test_backend import compiled_model
from tests.test_runtime_graphs import BUF, Caller, TinyStep, compiled, dynamic_artifact, int_buffer, make_step, \
    run_both

# ------------------------------------------------ 1: several writes into one buffer, overlapping when padded


def test_a_write_overlapping_an_earlier_one_only_when_padded_runs_eagerly():
    """Three writes into one buffer: the third, padded, overlaps the second (not the first). Every
    write's elements count against the later ones, or the third's padded rows would land on the
    second's real ones and be copied back into the caller's buffer."""
    body = "buf[0, :n].copy_(tokens)\nbuf[1, 6:6 + n].copy_(tokens + 100)\nbuf[1, :n].copy_(tokens)\nreturn logits"
    artifacts = run_both(body, int_buffer((2, 40)), [3, 5, 6, 3, 4], dynamic=True)
    art = dynamic_artifact(artifacts)
    assert art.signature.pad_reason is None
    assert art.stats["eager_fallbacks"] == 2  # 5 and 6 tokens: bucket 8 pads the third write over the second
    assert any("overlapping" in why and "b8" in why for why in art._fallbacks_logged)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 12), st.integers(1, 6)),
                min_size=1, max_size=5))
def test_overlapping_writes_finds_every_clash_with_any_earlier_write(writes):
    """Views of three buffers (rows, column ranges): a write clashes where it shares an element with
    any earlier write into the same buffer, whichever earlier one that is."""
    buffers = [torch.zeros(3, 20) for _ in range(3)]
    views = [buffers[b][row, start:start + length] for b, row, start, length in writes]
    expected = [b for i, (b, row, start, length) in enumerate(writes)
                if any(b2 == b and r2 == row and s2 < start + length and start < s2 + l2
                       for b2, r2, s2, l2 in writes[:i])]
    assert overlapping_writes(views, [b for b, *_ in writes]) == expected


# ------------------------------------------------ 2: a written region that shrinks as the step grows


def test_clearing_the_rest_of_a_buffer_is_captured_per_exact_size():
    """`buf[0, n:].fill_(-1)` ("clear the rest") writes a region that shrinks as the step grows: a
    padded step's region is not the real one's prefix, so the graph is captured per size."""
    body = "buf[0, :n].copy_(tokens)\nbuf[0, n:].fill_(-1)\nreturn logits"
    artifacts = run_both(body, int_buffer((1, BUF)), [3, 5, 2, 7, 3], dynamic=True)
    art = dynamic_artifact(artifacts)
    assert "does not grow with the step" in art.signature.pad_reason
    assert art.stats["replays"] >= 3


_N, _M = sympy.symbols("n m", integer=True, positive=True)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-3, 3), min_size=4, max_size=4), st.integers(1, 8), st.integers(1, 8))
def test_a_size_said_to_grow_never_shrinks(coefficients, n, m):
    """Soundness of `_grows` over polynomials in two sizes: where it says a size grows with the step,
    growing either size never makes it smaller."""
    a, b, c, d = coefficients
    expr = a * _N + b * _M + c * _N * _M + d
    if roles._grows(expr):
        value = lambda x, y: int(expr.subs({_N: x, _M: y}))  # noqa: E731
        assert value(n + 1, m) >= value(n, m) and value(n, m + 1) >= value(n, m), expr


# ------------------------------------------------ 4: a host scalar changed while no address moved


class ScaledStep(TinyStep):
    """Logits divided by a temperature, a 0-d CPU tensor the caller passes (a host scalar)."""

    def forward(self, ids, positions, block_table, seq_lens, query_start_loc, slot_mapping, temperature):
        return self.logits(ids, positions, block_table, seq_lens, query_start_loc, slot_mapping) / temperature


def test_a_changed_host_scalar_is_not_replayed_with_its_capture_value():
    torch._dynamo.reset()
    fn, artifacts = compiled(ScaledStep(), dynamic=True)
    reference = ScaledStep()
    caller = Caller(0)
    with torch.no_grad():
        for temperature in (1.0, 1.0, 0.5, 2.0, 2.0):
            inputs = caller.step(3)
            t = torch.tensor(temperature)
            torch.testing.assert_close(fn(**inputs, temperature=t), reference(**inputs, temperature=t))
    art = dynamic_artifact(artifacts)
    assert art.stats["recaptures"] == 2 and art.stats["replays"] == 5


# ------------------------------------------------ 5: hoisted metadata differing in a keyword argument


class TwoWindowsStep(TinyStep):
    """Two attention calls whose KV lengths the model derives from the same cumulative lengths,
    clamped to two different limits (keyword arguments): two hoisted metadata values, not one."""

    def forward(self, ids, positions, block_table, cu_seq_lens_q, cu_seq_lens_k, slot_mapping):
        lens = torch.diff(cu_seq_lens_k)
        near = torch.clamp(lens, max=8).to(torch.int32)
        far = torch.clamp(lens, max=24).to(torch.int32)
        x = self.embed[ids] + positions.unsqueeze(-1).float() * 0.01
        q = x.view(x.shape[0], 2, 8)
        kv = q[:, :1].contiguous()
        torch.ops.ascend.reshape_and_cache(kv, kv, self.key_cache, self.value_cache, slot_mapping)
        scale = 8 ** -0.5
        a = torch.ops.ascend.attention(q, self.key_cache, self.value_cache, block_table, near, cu_seq_lens_q, scale)
        b = torch.ops.ascend.attention(q, self.key_cache, self.value_cache, block_table, far, cu_seq_lens_q, scale)
        return (a + 2 * b).reshape(x.shape[0], -1) @ self.out


def test_metadata_differing_only_in_a_keyword_argument_is_not_merged():
    torch._dynamo.reset()
    fn, artifacts = compiled(TwoWindowsStep())
    reference = TwoWindowsStep()
    caller = Caller(1)
    with torch.no_grad():
        for size in (3, 5, 2, 4):
            raw = caller.step(size)
            cu_k = torch.tensor([0] + raw["seq_lens"].tolist()).cumsum(0).to(torch.int32)
            inputs = dict(ids=raw["ids"], positions=raw["positions"], block_table=raw["block_table"],
                          cu_seq_lens_q=raw["query_start_loc"], cu_seq_lens_k=cu_k, slot_mapping=raw["slot_mapping"])
            torch.testing.assert_close(fn(**inputs), reference(**inputs), atol=1e-5, rtol=1e-5)
    art = dynamic_artifact(artifacts)
    assert len(art.rewritten.prologue.names) == 2 and art.stats["replays"] >= 3


# ------------------------------------------------ 9 and 12: outputs per sequence; sequences with no query


PER_SEQUENCE = "return logits, logits[(query_start_loc[1:] - 1).clamp(min=0)]"


def per_sequence_steps(body: str, steps: list[tuple[list[int], list[int]]], runtime: str = "sim") -> list:
    """Run `steps` ((KV lengths, query lengths) each) compiled and eager; every output equal."""
    torch._dynamo.reset()
    fn, artifacts = compiled(make_step(body), dynamic=True, runtime=runtime)
    reference = make_step(body)
    batch = PagedBatch(LlamaConfig(vocab_size=16, num_heads=2, num_kv_heads=1, head_dim=8, block_size=4,
                                   num_blocks=256), seed=4, table_width=16)
    with torch.no_grad():
        for i, (lens, qlens) in enumerate(steps):
            raw = batch.step(lens, qlens)
            inputs = {"ids": raw["input_ids"], "positions": raw["positions"], "block_table": raw["block_table"],
                      "seq_lens": raw["seq_lens"], "query_start_loc": raw["query_start_loc"],
                      "slot_mapping": raw["slot_mapping"]}
            a, b = torch.zeros(1, BUF, dtype=torch.int64), torch.zeros(1, BUF, dtype=torch.int64)
            for got, expected in zip(fn(**inputs, buf=a), reference(**inputs, buf=b)):
                assert got.shape == expected.shape, f"step {i} {qlens}: {got.shape} != {expected.shape}"
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"step {i} {qlens}: {m}")
    return artifacts


def test_outputs_sized_by_the_sequence_count_follow_it_when_the_token_count_repeats():
    """Logits at each sequence's last token are `[B, V]`: two steps of 6 tokens with 3 and then 2
    sequences return 3 and 2 rows."""
    artifacts = per_sequence_steps(PER_SEQUENCE, [([9, 9, 9], [2, 2, 2]), ([9, 9], [3, 3]), ([9, 9, 9], [2, 2, 2])])
    assert sum(a.stats["replays"] for a in artifacts) == 3


def test_a_sequence_with_no_query_tokens_is_not_served_as_decode():
    """As many tokens as sequences, but one sequence has none and another two (a padded request beside
    a chunk): a mixed step, not a decode one."""
    artifacts = per_sequence_steps("return logits", [([9, 9, 9], [1, 1, 1]), ([9, 9, 9], [2, 0, 1]),
                                                     ([9, 9, 9], [1, 1, 1])])
    keys = {str(g.key) for a in artifacts for g in a.graphs.values() if g.graph is not None}
    assert any(k.endswith(".mixed") for k in keys), keys


class _Pair:
    """One compiled step function and its eager twin, built once for the property test below."""

    def __init__(self) -> None:
        torch._dynamo.reset()
        self.fn, self.artifacts = compiled(make_step(PER_SEQUENCE), dynamic=True)
        self.reference = make_step(PER_SEQUENCE)
        self.batch = PagedBatch(LlamaConfig(vocab_size=16, num_heads=2, num_kv_heads=1, head_dim=8, block_size=4,
                                            num_blocks=256), seed=5, table_width=16)


_PAIR: list[_Pair] = []


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), min_size=1, max_size=4))
def test_random_steps_with_empty_and_chunked_sequences_equal_eager(steps):
    """Steps of 1-5 sequences of 0-3 query tokens each, in any order, through one artifact: every
    output (per token and per sequence) equals eager's, whatever step shapes came before."""
    if not _PAIR:
        _PAIR.append(_Pair())
    pair = _PAIR[0]
    with torch.no_grad():
        for qlens in steps:
            if not sum(qlens):
                continue
            raw = pair.batch.step([q + 5 for q in qlens], qlens)
            inputs = {"ids": raw["input_ids"], "positions": raw["positions"], "block_table": raw["block_table"],
                      "seq_lens": raw["seq_lens"], "query_start_loc": raw["query_start_loc"],
                      "slot_mapping": raw["slot_mapping"]}
            a, b = torch.zeros(1, BUF, dtype=torch.int64), torch.zeros(1, BUF, dtype=torch.int64)
            for got, expected in zip(pair.fn(**inputs, buf=a), pair.reference(**inputs, buf=b)):
                assert got.shape == expected.shape, (qlens, got.shape, expected.shape)
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
