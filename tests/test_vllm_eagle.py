"""vLLM's EAGLE drafter and its Llama target, both compiled by us, on vLLM's own code, 0.23.0 or 0.33.0
(`tests/vllm_eagle.py`): 20+ steps of vLLM's padded-batch speculative loop mixing speculative and plain
decode requests, prefills, steps proposing fewer drafts than k and requests taking fewer, each step's
drafts used, accepted and proposed equal to vLLM's eager models, hidden states close, and both models'
graphs captured and replayed, each with its own artifact and update table. Skipped where vLLM does not
import (the main venv); `.ci/run` runs this file in `.venv-vllm` (0.23) and `.venv-vllm33` (0.33)."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM not installed: .ci/run runs this file in .venv-vllm and .venv-vllm33")

from ascend_compile.integrations import vllm as integration  # noqa: E402
from tests import vllm_eagle as eagle  # noqa: E402

#: Per step: the drafts the drafter proposes (k_step <= K: vLLM 0.33's `num_speculative_tokens_per_batch_size`
#: lowers it by batch size) and the drafts a request may take ({index: n}: a scheduler's truncation).
SCHEDULE = [(3, {}), (3, {}), (2, {1: 1}), (1, {}), (3, {0: 2}), (3, {}), (3, {}), (2, {}), (3, {2: 0}),
            (1, {}), (3, {3: 1}), (3, {}), (2, {}), (3, {}), (3, {0: 1, 1: 2}), (1, {}), (3, {}), (3, {}),
            (2, {}), (3, {}), (3, {1: 0}), (3, {}), (2, {}), (3, {})]
#: (prompt length, speculative, the step it joins at): request 2 is a plain decode request throughout.
REQUESTS = [(7, True, 0), (12, True, 0), (5, False, 0), (9, True, 6)]


@pytest.fixture
def compiled(monkeypatch, tmp_path):
    """(artifacts per backend made, make): the first backend is the target's (vLLM's mode-1 call), the
    second the drafter's."""
    made = []
    original = integration.backend

    def recording(*args, **kwargs):
        artifacts = []
        made.append(artifacts)
        return original(*args, on_compiled=artifacts.append, **kwargs)

    monkeypatch.setattr(integration.dynamo_backend, "backend", recording)  # where configured_backend looks it up
    monkeypatch.delenv("ASCEND_COMPILE_OPTIONS", raising=False)
    torch._dynamo.reset()
    yield made, lambda **kwargs: eagle.compiled_and_eager(monkeypatch, tmp_path, **kwargs)
    torch._dynamo.reset()


def _requests(step: int) -> list[eagle.Request]:
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (n,), generator=generator).tolist() for n, _, _ in REQUESTS]
    return [eagle.Request(p, speculative=s) for p, (_, s, joins) in zip(prompts, REQUESTS) if joins <= step]


def test_eagle_drafter_and_target_compiled_by_us_propose_and_accept_as_eager(compiled):
    made, make = compiled
    pairs = make(options={"capture_sizes": [4, 8, 16]})
    batches = [_requests(0), _requests(0)]
    accepted = used = 0
    for i, (k_step, truncate) in enumerate(SCHEDULE):
        for batch in batches:
            batch.extend(copy.deepcopy(r) for r in _requests(i)[len(batch):])
        got, expected = (eagle.engine_step(pair, batch, k_step, truncate) for pair, batch in zip(pairs, batches))
        assert (got.used, got.accepted, got.proposed) == (expected.used, expected.accepted, expected.proposed), i
        torch.testing.assert_close(got.target_hidden, expected.target_hidden, atol=2e-5, rtol=1e-4)
        for g, e in zip(got.drafter_hidden, expected.drafter_hidden):
            torch.testing.assert_close(g, e, atol=2e-5, rtol=1e-4)
        accepted += sum(map(len, got.accepted))
        used += sum(map(len, got.used))
    print("accepted", accepted, "of", used)
    for got, expected in zip(pairs[0].target.caches() + pairs[0].drafter.caches(),
                             pairs[1].target.caches() + pairs[1].drafter.caches()):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert 0 < accepted < used
    (target,), (drafter,) = made
    for art in (target, drafter):
        print(dict(art.stats))
