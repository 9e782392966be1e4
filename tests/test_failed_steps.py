"""Failed steps (issue 36): what `capture_all` captures for a graph whose steps are not padded, and
a compiled step that raises after some layers wrote their KV rows leaving every cache and written
input as before the step."""
from __future__ import annotations

import torch
import pytest

from examples.llama import LlamaConfig, PagedBatch, build
from tests.test_backend import MAX_LEN, compiled_model

TOL = dict(atol=2e-5, rtol=1e-4)


def caches(model: torch.nn.Module) -> list[torch.Tensor]:
    return [b for name, b in model.named_buffers() if name.endswith("_cache")]


def assert_caches_close(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    for got, want in zip(caches(model), caches(reference), strict=True):
        torch.testing.assert_close(got, want, **TOL)


#: A plain `torch.compile` (automatic dynamic): the first step's graph is static, the next ones are
#: dynamic with one sequence kept static (a one-sequence mixed step), then fully dynamic.
STEPS = [([20], [5]), ([33], None), ([50, 60, 70], [3, 2, 1]), ([20], [5]), ([12], None), ([40, 41], [4, 3])]


@pytest.mark.parametrize("policy", ["auto", "pa_max_batch"])
@pytest.mark.parametrize("first", [[([30, 40, 50], None)], []], ids=["decode-first", "mixed-first"])
def test_capture_all_serves_a_one_sequence_mixed_step_and_later_steps(policy, first):
    """With `capture_all`, a graph whose sizes are not padded to the buckets (dynamo's static first
    graph, or one with a static sequence count) captures the step's own graph only: every bucket's
    decode graph captured at a mixed step's sizes put 5 query tokens of one sequence into PA. A
    first step that is mixed gets its mixed graph captured too (capture_all captures decode graphs)."""
    cfg = LlamaConfig(num_layers=2, num_blocks=1024)
    model, reference = build(cfg), build(cfg)
    fn, artifacts = compiled_model(model, max_model_len=MAX_LEN, capture_sizes=(1, 2, 4, 8), capture_all=True,
                                   kernel_policy=policy)
    batch = PagedBatch(cfg, seed=1)
    with torch.no_grad():
        for lens, query_lens in first + STEPS:
            inputs = batch.step(lens, query_lens)
            torch.testing.assert_close(fn(**inputs), reference(**inputs), **TOL)
            assert_caches_close(model, reference)
    stats = [a.stats for a in artifacts]
    assert sum(s["eager_fallbacks"] for s in stats) == 0 and sum(s["replays"] for s in stats) == len(first + STEPS)
    for art in artifacts:
        captured = {g.name for g in art.graphs.values() if g.graph is not None}
        if art.signature.can_pad and not isinstance(art.signature.tokens, int):  # padded: every decode bucket
            assert {"b1.decode", "b2.decode", "b4.decode", "b8.decode"} <= captured, captured
        else:  # each size its own capture: only the graphs of the steps it served
            assert len(captured) == art.stats["captures"] <= art.stats["steps"], captured
