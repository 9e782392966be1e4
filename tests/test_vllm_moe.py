"""vLLM's own MoE model (GLM-4.5's grouped top-k routing, `tests/vllm_moe.py`) through our backend, on vLLM's
own code (0.23.0 or 0.33.0): decode steps inside the buckets, mixed steps and steps above the largest
capture size, and a weight reload, each equal to vLLM's eager model. Skipped where vLLM does not import
(the main venv); `.ci/run` runs this file in `.venv-vllm` (0.23) and `.venv-vllm33` (0.33)."""
from __future__ import annotations

import collections

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM not installed: .ci/run runs this file in .venv-vllm and .venv-vllm33")

from ascend_compile.integrations import vllm as integration  # noqa: E402
from tests import vllm_moe as moe  # noqa: E402
from tests import vllm_real as real  # noqa: E402

#: (seq_lens, query_lens): decode batches inside the buckets (4, 8), mixed steps inside and above them,
#: prefills above them (12 to 40 tokens), decodes again.
STEPS = [
    ([5, 6, 7], [1, 1, 1]), ([9], [1]), ([20], [12]), ([30, 8], [10, 3]), ([10, 11], [1, 1]), ([40], [20]),
    ([41], [1]), ([12, 13, 14, 15], [1, 1, 1, 1]), ([16], [3]), ([50, 20], [24, 16]), ([17, 18], [2, 1]),
    ([21] * 8, [1] * 8), ([60], [9]), ([61, 62], [1, 1]), ([33, 34, 35], [11, 1, 1]), ([22], [1]),
    ([70], [40]), ([23, 24, 25], [1, 1, 1]), ([26], [2]), ([80, 81], [1, 1]), ([27], [1]), ([90, 30], [13, 5]),
]

#: The step before which both models' weights are reloaded (a sleep and wake), in place.
RELOAD = 14


@pytest.fixture
def compiled(monkeypatch, tmp_path):
    """(artifacts, models): vLLM's tiny GLM-4.5 built twice, the first compiled through vLLM's own
    mode-1 call with our backend by qualified name (capture sizes 4 and 8), the second eager."""
    artifacts = []
    original = integration.backend

    def recording(*args, **kwargs):
        return original(*args, on_compiled=artifacts.append, **kwargs)

    monkeypatch.setattr(integration.dynamo_backend, "backend", recording)
    monkeypatch.delenv("ASCEND_COMPILE_OPTIONS", raising=False)
    torch._dynamo.reset()
    yield artifacts, moe.compiled_and_eager(monkeypatch, tmp_path, options={"capture_sizes": [4, 8]})
    torch._dynamo.reset()


def test_grouped_topk_moe_steps_inside_mixed_and_above_the_buckets_equal_eager_on_pieces(compiled):
    """Every step equal to vLLM's eager model, before and after a weight reload (the graphs read the
    parameters in place: the new weights, without a capture). The routing's `group_mask.scatter_` (in place, on a value
    the graph made) runs inside a piece whose capture reads an earlier piece's `group_idx`: it must see
    that step's value (the report: "index -1 is out of bounds", a capture reading what an earlier
    capture left), and each piece's replay the live values of the step. `vllm.cpu_fused_moe_torch`
    (0.23's experts) reads the expert counts on the host: the full graphs holding it are not captured,
    so every step runs on piece replays with that op between them; 0.33's experts (the stand-in for its
    CPU kernel) read nothing on the host: the buckets' steps replay full graphs."""
    artifacts, models = compiled
    for i, (seq_lens, query_lens) in enumerate(STEPS):
        if i == RELOAD:
            before = [t.clone() for t in models[0].model.parameters()]
            for model in models:
                moe.reload_weights(model, seed=11)
            assert all((t - p).abs().max() > 0.1 for t, p in zip(before, models[0].model.parameters()))
        step = real.Step(seq_lens, query_lens)
        got, expected = moe.run(models[0], step), moe.run(models[1], step)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4, msg=lambda m: f"step {i} {step}: {m}")
    for got, expected in zip(models[0].caches(), models[1].caches()):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    art = artifacts[-1]  # the graph serving the steps (an earlier one: the profiling run's static trace)
    stats = collections.Counter(art.stats)
    in_buckets = sum(sum(q) <= 8 for _, q in STEPS)
    assert stats["eager_fallbacks"] == 0 and art.pieces.launches["replays"] >= 2 * len(STEPS), (stats, art.pieces.launches)
    keys = {graph.key.bucket for graph in art.pieces.graphs.values()}
    if moe.HOST_READ_EXPERTS:  # 0.23's experts: no full graph captured, every step on pieces
        assert any("cpu_fused_moe_torch" in str(op) for op in art.uncapturable), art.uncapturable
        assert stats["piecewise_steps"] == len(STEPS) and stats["replays"] == 0, stats
        assert min(keys) <= 8 < max(keys), keys
    else:  # 0.33's: full graphs in the buckets, pieces above them
        assert not art.uncapturable, art.uncapturable
        assert stats["replays"] == in_buckets and stats["piecewise_steps"] == len(STEPS) - in_buckets, stats
        assert min(keys) > 8, keys
