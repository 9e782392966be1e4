"""vLLM's multi-LoRA serving through our backend, on vLLM's own code, 0.23.0 or 0.33.0 (`tests/vllm_lora.py`):
vLLM's LoRA manager wraps its Llama before vLLM's mode-1 compile call, two adapters are active, and each
step's adapter mapping is set as vLLM's runner sets it. Skipped where vLLM does not import (the main
venv); `.ci/run` runs this file in `.venv-vllm` (0.23) and `.venv-vllm33` (0.33)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM not installed: .ci/run runs this file in .venv-vllm and .venv-vllm33")

from ascend_compile.integrations import vllm as integration  # noqa: E402
from tests import vllm_lora as lora  # noqa: E402

#: (seq_lens, query_lens, each request's adapter: 0 none, 1 or 2): lone one-token decodes (each
#: adapter and none), decode batches mixing both adapters and none, a prefill and a mixed step (above
#: and inside the buckets), then lone decodes again.
STEPS = [
    ([5], [1], [1]), ([6], [1], [2]), ([7], [1], [0]),
    ([9, 17, 4], [1, 1, 1], [1, 2, 0]), ([10, 18, 5], [1, 1, 1], [2, 2, 1]),
    ([8], [1], [1]), ([21, 22, 23, 24], [1, 1, 1, 1], [0, 1, 2, 1]),
    ([12], [3], [2]), ([30, 7], [2, 1], [1, 2]),
    ([9], [1], [2]), ([6, 8, 10, 12, 14], [1] * 5, [1, 0, 2, 2, 1]),
    ([40], [24], [1]), ([50, 60, 70], [3, 2, 4], [2, 0, 1]),
    ([10], [1], [0]), ([20] * 8, [1] * 8, [1, 2] * 4),
    ([11, 13], [1, 1], [2, 1]), ([11], [1], [1]), ([12], [1], [2]),
    ([41, 61], [1, 1], [1, 1]), ([13], [1], [1]), ([14, 15, 16], [1, 1, 1], [0, 0, 0]), ([15], [1], [2]),
]


@pytest.fixture
def compiled(monkeypatch, tmp_path):
    """(artifacts, make): `make(**kwargs)` builds vLLM's LoRA-wrapped Llama twice, the first compiled
    through vLLM's own mode-1 call with our backend by qualified name, the second eager."""
    artifacts = []
    original = integration.backend

    def recording(*args, **kwargs):
        return original(*args, on_compiled=artifacts.append, **kwargs)

    monkeypatch.setattr(integration.dynamo_backend, "backend", recording)  # where configured_backend looks it up
    monkeypatch.delenv("ASCEND_COMPILE_OPTIONS", raising=False)
    torch._dynamo.reset()
    yield artifacts, lambda **kwargs: lora.compiled_and_eager(monkeypatch, tmp_path, **kwargs)
    torch._dynamo.reset()


def _equal_to_eager(models, steps) -> None:
    for i, (seq_lens, query_lens, adapters) in enumerate(steps):
        step = lora.LoraStep(seq_lens, query_lens, adapters)
        got, expected = lora.run(models[0], step), lora.run(models[1], step)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4, msg=lambda m: f"step {i} {step}: {m}")
    for got, expected in zip(models[0].caches(), models[1].caches()):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_lora_steps_of_one_token_two_adapters_mixed_and_prefill_equal_eager_on_full_graphs(compiled):
    """Lone one-token decodes (the step vLLM traces its graph at when its first step is one), decode
    batches mixing two adapters and none, a prefill and a mixed step: every step equal to vLLM's
    eager model with the same adapters; the steps in the buckets replay full graphs."""
    artifacts, make = compiled
    models = make(options={"capture_sizes": [4, 8]})
    _equal_to_eager(models, STEPS)
    stats = {}
    for art in artifacts:
        for name, value in art.stats.items():
            stats[name] = stats.get(name, 0) + value
    in_buckets = sum(sum(q) <= 8 for _, q, _ in STEPS)
    assert stats["steps"] == len(STEPS)
    assert stats["replays"] == in_buckets and stats["eager_fallbacks"] == 0, stats
