"""vLLM's mode-1 compile (`model.compile(fullgraph=True, backend=...)`) of the stand-in model (`tests/test_vllm.py`'s
`Pair`) with the backend's default `dispatch="direct"`: at the first compiled step the direct dispatcher is put in
front of the model's compiled call (`integrations/vllm/fast_path.py`), and every later step goes straight to the
graph after one call of its layout through dynamo's guards, equal to eager. With `dispatch="dynamo"` every step
goes through dynamo. On vLLM's own Llama: `tests/test_vllm_real.py`."""
from __future__ import annotations

import random

import pytest
import torch

from ascend_compile.config import CompileConfig
from ascend_compile.integrations import vllm as integration
from ascend_compile.integrations.vllm import fast_path
from ascend_compile.lowering import served
from tests import vllm_standin as v
from tests.test_vllm import BUCKETS, MAX_LEN, Pair

STEPS = [(2, False), (3, False), (1, False), (4, True), (2, False), (6, False)]


def _mode_1(dispatch: str) -> tuple[Pair, list]:
    artifacts: list = []
    pair = Pair("FLASH_ATTN", 16, "sim", artifacts)
    compile_fn = integration.backend(CompileConfig(max_model_len=MAX_LEN, capture_sizes=BUCKETS, runtime="sim"),
                                     on_compiled=artifacts.append, get_forward_context=v.get_forward_context,
                                     dispatch=dispatch)
    torch._dynamo.reset()
    pair.models[0].compile(fullgraph=True, backend=compile_fn)
    pair.compiled = pair.models[0]
    return pair, artifacts


def _run(pair: Pair) -> list[bool]:
    """Each step's whether dynamo's path served it (the graph reported through its probe)."""
    rng, through_dynamo = random.Random(7), []
    for batch, mixed in STEPS:
        with served.probe() as calls:
            got, expected = pair.run(pair.step(rng, batch, mixed))
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
        through_dynamo.append(bool(calls))
    return through_dynamo


@pytest.mark.skipif(fast_path.fast_path_refusal("vllm_fast_path") is not None, reason="fast path not proven here")
def test_after_the_first_compiled_step_vllm_steps_go_straight_to_the_graph():
    pair, artifacts = _mode_1("direct")
    through_dynamo = _run(pair)
    direct = pair.models[0]._compiled_call_impl
    assert isinstance(direct, fast_path.DirectCall)
    assert direct.dispatcher.guard_policy is fast_path.guard_refusal
    assert len(artifacts) == 1 and direct.dynamo_calls == through_dynamo[1:].count(True)
    assert through_dynamo[:2] == [True, True] and not any(through_dynamo[2:])  # compiled; armed; direct after


def test_with_dispatch_dynamo_every_step_goes_through_dynamo():
    pair, artifacts = _mode_1("dynamo")
    assert all(_run(pair))
    assert not isinstance(pair.models[0]._compiled_call_impl, fast_path.DirectCall)
