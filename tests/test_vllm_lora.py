"""vLLM's multi-LoRA serving through our backend, on vLLM's own code, 0.23.0 or 0.33.0 (`tests/vllm_lora.py`):
vLLM's LoRA manager wraps its Llama before vLLM's mode-1 compile call, two adapters are active, and each
step's adapter mapping is set as vLLM's runner sets it. Skipped where vLLM does not import (the main
venv); `.ci/run` runs this file in `.venv-vllm` (0.23) and `.venv-vllm33` (0.33)."""
from __future__ import annotations

import collections

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM not installed: .ci/run runs this file in .venv-vllm and .venv-vllm33")

from ascend_compile.integrations import vllm as integration  # noqa: E402
from tests import vllm_lora as lora  # noqa: E402

#: (seq_lens, query_lens, each request's adapter: 0 none, 1 or 2): lone one-token decodes (each
#: adapter and none), decode batches mixing both adapters and none, a prefill and a mixed step above
#: the buckets (4, 8) and a mixed one inside, then lone decodes again.
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
#: The first step, the one dynamo traces the graph at: one token (a size every stacked adapter weight
#: has, `[max_loras, 1, rank, in]`, and the punica wrapper's `[1]` flags), or two (`max_loras`).
FIRST = {"one_token": ([4], [1], [2]), "two_tokens": ([4, 5], [1, 1], [1, 2])}


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


@pytest.mark.parametrize("first", sorted(FIRST))
def test_lora_steps_of_one_token_two_adapters_mixed_and_prefill_equal_eager_on_full_graphs(compiled, first):
    """Traced at its first step (one token, the report: a CaptureError at every lone decode; or two),
    one graph serves lone one-token decodes, decode batches mixing two adapters and none, prefill and
    mixed steps, each equal to vLLM's eager model with the same adapters: the steps in the buckets
    replay full graphs, the two above them run piecewise. Only the step's inputs carry the token
    count: no tensor the model holds (adapter stacks, punica buffers) is sized by it or padded."""
    artifacts, make = compiled
    models = make(options={"capture_sizes": [4, 8]})
    steps = [FIRST[first], *STEPS]
    _equal_to_eager(models, steps)
    (art,) = artifacts  # one dynamo graph, one artifact: no recompile for another token count
    stats = collections.Counter(art.stats)
    in_buckets = sum(sum(q) <= 8 for _, q, _ in steps)
    assert stats["steps"] == len(steps) and stats["eager_fallbacks"] == 0, stats
    assert stats["replays"] == in_buckets and stats["piecewise_steps"] == len(steps) - in_buckets, stats
    signature = art.signature
    assert not signature.specialized and signature.can_pad, signature.pad_reason
    held = [spec for spec in signature.inputs if "lora" in spec.name or "punica" in spec.name]
    assert held and all(spec.role.value == "static" and not spec.dynamic for spec in held), [
        (spec.name, spec.role.value, spec.shape) for spec in held if spec.role.value != "static" or spec.dynamic]


def test_a_held_tensor_traced_with_the_token_count_is_never_padded(compiled, monkeypatch):
    """The roles' own guard, with the held tensors left symbolic in the retrace (`model_state_static`
    off): dynamo gives the stacks' size-1 dim and the `[1]` flags the token count's symbol at a one-token
    trace, yet they stay static inputs, used in place, and the graph is not padded (each step size its
    own capture) instead of padding the weights: every step equal to eager, no capture failing."""
    artifacts, make = compiled
    monkeypatch.setattr(integration.dynamo_backend, "model_state_static", lambda gm, example_inputs: None)
    models = make(options={"capture_sizes": [4, 8]})
    _equal_to_eager(models, [FIRST["one_token"], ([9, 17, 4], [1, 1, 1], [1, 2, 0]), ([8], [1], [1])])
    reasons = [art.signature.pad_reason for art in artifacts]
    assert reasons[0] and "a static input (used in place) has a token-sized dimension" in reasons[0], reasons
    for art in artifacts:
        held = [spec for spec in art.signature.inputs if "lora" in spec.name or "punica" in spec.name]
        assert {spec.role.value for spec in held} == {"static"}
        assert art.stats.get("eager_fallbacks", 0) == 0


def test_the_stand_in_kernels_compute_what_vllms_torch_punica_ops_do(tmp_path):
    """The harness's stand-ins for the two Triton kernels under vLLM's CUDA punica wrapper give, in eager,
    the outputs of vLLM's own pure-torch punica wrapper (`PunicaWrapperCPU`, SGMV path as vLLM's runner
    asks with `is_prefill=True`), on steps whose tokens all have an adapter or none (0.23's torch ops
    give a no-adapter token among others slot -1, the last adapter); and the adapters matter."""
    models = []
    for punica in (lora.PUNICA_GPU, lora.PUNICA_CPU):
        path = tmp_path / punica.rsplit(".", 1)[1]
        path.mkdir()
        models.append(lora.build(lora.vllm_config(path), seed=3, punica=punica))
    steps = [([5], [1], [1]), ([5], [1], [2]), ([5], [1], [0]), ([9, 17, 4], [1, 2, 3], [1, 2, 2]),
             ([30, 7], [2, 1], [0, 0]), ([40], [24], [2])]
    outputs = []
    for seq_lens, query_lens, adapters in steps:
        step = lora.LoraStep(seq_lens, query_lens, adapters)
        got, expected = (lora.run(model, step) for model in models)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        outputs.append(got)
    one_token = outputs[:3]  # the same step with adapter 1, 2 and none
    assert all((x - y).abs().max() > 1e-3 for i, x in enumerate(one_token) for y in one_token[i + 1:])
